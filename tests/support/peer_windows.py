"""Ask a peer daemon for windows it must refuse or book, as a token holder; print JSON.

    python tests/support/peer_windows.py ADDRESS TOKEN SET_ID refuse N [N...]
    python tests/support/peer_windows.py ADDRESS TOKEN SET_ID stack K

refuse: for each N, a fill of its own asks for one window of N bytes; prints
{"codes": [status name or "GRANTED", ...]}. stack: K fills each ask for the
whole set at once (one window); once one is granted (the others then wait
behind it under the rate cap), every fill hangs up; prints {"granted": n}.
Run in a network namespace of its own (ip netns exec), as the attacker.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading

import grpc
from peer_open import OpenFill, open_fill, own_channel

#: The client's own deadline: far beyond what any answer here should take.
CLIENT_DEADLINE_S = 120.0


def refuse(address: str, token: str, set_id: str, sizes: list[int]) -> dict[str, object]:
    codes = []
    for n in sizes:
        with own_channel(address) as channel:
            fill = open_fill(address, token, set_id, CLIENT_DEADLINE_S, channel)
            fill.ask(n)
            try:
                fill.reply()
                codes.append("GRANTED")
            except grpc.RpcError as e:
                codes.append(f"{e.code().name}: {e.details()}")
            fill.close()
    return {"codes": codes}


def stack(address: str, token: str, set_id: str, count: int) -> dict[str, object]:
    channels = [own_channel(address) for _ in range(count)]
    fills = [open_fill(address, token, set_id, CLIENT_DEADLINE_S, ch) for ch in channels]
    nbytes = sum(r.nbytes for r in fills[0].offer.regions)
    granted = threading.Event()

    def wait(fill: OpenFill) -> None:
        with contextlib.suppress(grpc.RpcError):
            fill.reply()
            granted.set()

    waiting = [threading.Thread(target=wait, args=(f,)) for f in fills]
    for fill, thread in zip(fills, waiting, strict=True):
        fill.ask(nbytes)
        thread.start()
    # The booking the daemon took first is granted at once; the rest wait behind it.
    assert granted.wait(CLIENT_DEADLINE_S), "no window was granted"
    for fill in fills:
        fill.close()
    for thread in waiting:
        thread.join()
    for ch in channels:
        ch.close()
    return {"granted": 1, "booked": count, "bytes": nbytes}


def main() -> int:
    address, token, set_id, mode, *rest = sys.argv[1:]
    if mode == "refuse":
        out = refuse(address, token, set_id, [int(n) for n in rest])
    else:
        out = stack(address, token, set_id, int(rest[0]))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
