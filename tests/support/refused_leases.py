"""Attach a checkpoint this user may not read, COUNT times, and try to collect each lease.

    python tests/support/refused_leases.py SOCKET FD_SOCKET CHECKPOINT SET_ID COUNT

Each attach names CHECKPOINT (the daemon reads it; this user cannot) and
accepts descriptors; each lease is then presented on the fd channel, which
refuses it. Prints {"refused": [error class names]} and holds the streams
until a line on stdin; then prints {"ended": how many of the streams the daemon
had ended}. Run as another user (tests/support/run_as.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import grpc

from engramd_client import EngramdError
from engramd_client.fdchannel import collect
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

#: How long a held attach stream is waited for to end, once told to stop.
ENDED_WITHIN_S = 10.0


def main() -> int:
    socket, fd_socket, checkpoint, set_id, count = sys.argv[1:6]
    with open_channel(ClientConfig(socket=socket)) as channel:
        stub = pb_grpc.TableServiceStub(channel)
        request = pb.AttachRequest(
            set_id=set_id, checkpoint=checkpoint, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD]
        )
        calls, refused, ended = [], [], 0
        for _ in range(int(count)):
            call = stub.Attach(request, timeout=120)
            calls.append(call)
            attached = next(e for e in call if e.WhichOneof("event") == "attached").attached
            try:
                fds = collect(fd_socket, attached.lease_id, attached.fd_channel.secret, 10)
                for fd in fds.values():
                    os.close(fd)
                refused.append("")
            except EngramdError as e:
                refused.append(type(e).__name__)
        print(json.dumps({"refused": refused}), flush=True)
        sys.stdin.readline()
        for call in calls:
            # A stream the daemon ended ends the iteration; one it holds is cancelled here.
            timer = threading.Timer(ENDED_WITHIN_S, call.cancel)
            timer.start()
            try:
                next(call, None)
                ended += 1
            except grpc.RpcError:
                pass
            timer.cancel()
        print(json.dumps({"ended": ended}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
