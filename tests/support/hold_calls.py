"""Try to hold worker-socket connections busy forever; print how the daemon ended it.

    python tests/support/hold_calls.py SOCKET COUNT

On COUNT connections of their own: a Health/Watch stream, and a Status call
whose request message never comes (its headers are sent, then nothing).
Prints {"watch": [...], "half": [...], "details": ..., "seconds": ...}: for
each, the status code name ("STREAMED" where Watch answered), the daemon's
words for the first half-sent call, and how long the slowest of those took.
Run as another user (tests/support/run_as.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: The client's own deadline: far beyond the daemon's.
CLIENT_DEADLINE_S = 20.0


def _watch(channel: grpc.Channel) -> str:
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=CLIENT_DEADLINE_S
    )
    try:
        next(stream)
    except grpc.RpcError as e:
        return str(e.code().name)
    stream.cancel()
    return "STREAMED"


def _half_sent(channel: grpc.Channel, release: threading.Event) -> tuple[str, str, float]:
    def nothing() -> Iterator[bytes]:
        # The request never comes; the iterator ends only once the test is over.
        release.wait()
        return
        yield b""

    # The unary method called as a client stream: headers go out, no message follows.
    call = channel.stream_unary("/engramd.v1.TableService/Status")
    started = time.monotonic()
    try:
        call(nothing(), timeout=CLIENT_DEADLINE_S)
    except grpc.RpcError as e:
        return str(e.code().name), str(e.details()), time.monotonic() - started
    return "OK", "", time.monotonic() - started


def main() -> int:
    socket, count = sys.argv[1], int(sys.argv[2])
    # A subchannel pool of each channel's own: one connection per channel.
    channels = [
        grpc.insecure_channel(f"unix:{socket}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]
    release = threading.Event()
    with ThreadPoolExecutor(2 * count) as pool:
        watches = [pool.submit(_watch, ch) for ch in channels]
        halves = [pool.submit(_half_sent, ch, release) for ch in channels]
        half = [f.result() for f in halves]
        release.set()
        watch = [f.result() for f in watches]
    for ch in channels:
        ch.close()
    print(
        json.dumps(
            {
                "watch": watch,
                "half": [code for code, _, _ in half],
                "details": half[0][1],
                "seconds": max(s for _, _, s in half),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
