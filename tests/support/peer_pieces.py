"""Ask a peer daemon for pieces it must refuse, or hold its serving slots, as a token holder.

    python tests/support/peer_pieces.py ADDRESS TOKEN SET_ID refuse P [P...]
    python tests/support/peer_pieces.py ADDRESS TOKEN SET_ID hog

refuse: for each P, a fill of its own asks for piece P; prints {"codes": [status name or
the answer's kind, ...]}. hog: one stream asks for every piece and never reads one nor says
`done`; a second stream says `done` for every piece (none of them its own) and asks for
every piece again; prints {"granted": n, "busy": m, "second": [answers]} and keeps both
streams open until stdin closes. Run in a network namespace of its own (ip netns exec), as
the attacker.
"""

from __future__ import annotations

import json
import sys

import grpc
from peer_open import open_fill, own_channel

from engramd.strong import set_pieces

#: The client's own deadline: far beyond what any answer here should take.
CLIENT_DEADLINE_S = 300.0


def refuse(address: str, token: str, set_id: str, pieces: list[int]) -> dict[str, object]:
    codes = []
    for p in pieces:
        with own_channel(address) as channel:
            fill = open_fill(address, token, set_id, CLIENT_DEADLINE_S, channel)
            try:
                codes.append(str(fill.piece(p).WhichOneof("step")))
            except grpc.RpcError as e:
                codes.append(f"{e.code().name}: {e.details()}")
            fill.close()
    return {"codes": codes}


def hog(address: str, token: str, set_id: str) -> None:
    first = open_fill(address, token, set_id, CLIENT_DEADLINE_S, own_channel(address))
    count = len(set_pieces([r.nbytes for r in first.offer.regions]))
    kinds = [str(first.piece(p).WhichOneof("step")) for p in range(count)]
    second = open_fill(address, token, set_id, CLIENT_DEADLINE_S, own_channel(address))
    for p in range(count):
        second.done(p)
    answers = [str(second.piece(p).WhichOneof("step")) for p in range(count)]
    doc = {"granted": kinds.count("piece"), "busy": kinds.count("busy"), "second": answers}
    print(json.dumps(doc), flush=True)
    sys.stdin.read()
    first.close()
    second.close()


def main() -> int:
    address, token, set_id, mode, *rest = sys.argv[1:]
    if mode == "refuse":
        print(json.dumps(refuse(address, token, set_id, [int(p) for p in rest])), flush=True)
    else:
        hog(address, token, set_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
