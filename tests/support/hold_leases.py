"""Hold first descriptor attaches that never collect, until told to stop.

    python tests/support/hold_leases.py SOCKET COUNT

Attaches the daemon's one set by id COUNT times, accepting descriptors,
and never comes to the fd channel. Prints {"attached": n, "refused":
[status names]} once every attach answered, then holds the streams until
a line on stdin. Run as another user (tests/support/run_as.py).
"""

from __future__ import annotations

import json
import os
import sys

import grpc

from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc


def main() -> int:
    socket, count = sys.argv[1], int(sys.argv[2])
    with open_channel(ClientConfig(socket=socket)) as channel:
        stub = pb_grpc.TableServiceStub(channel)
        [held] = stub.Status(pb.StatusRequest(), timeout=10).sets
        request = pb.AttachRequest(set_id=held.set_id, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD])
        calls = [stub.Attach(request, timeout=120) for _ in range(count)]
        attached, refused = 0, []
        for call in calls:
            try:
                next(e for e in call if e.WhichOneof("event") == "attached")
                attached += 1
            except grpc.RpcError as e:
                refused.append(str(e.code().name))
        print(json.dumps({"attached": attached, "refused": refused}), flush=True)
        sys.stdin.readline()
        for call in calls:
            call.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
