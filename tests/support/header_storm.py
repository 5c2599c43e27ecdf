"""One member's storm of attaches naming checkpoints with huge headers; print what it got.

    python tests/support/header_storm.py SOCKET SECONDS THREADS CHECKPOINT [CHECKPOINT...]

THREADS threads attach, one after another for SECONDS, the CHECKPOINTs in
turn (each a folder of this user's whose first shard's header is huge), each
time touching that shard first, so the daemon's kept plans and parsed headers
never serve it again. Prints {"attaches": n, "codes": {status: count}}. Run as
another user (tests/support/run_as.py).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

import grpc

from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc


def main() -> int:
    socket, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    folders = [Path(p) for p in sys.argv[4:]]
    codes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    turns = itertools.cycle(folders)
    deadline = time.monotonic() + seconds

    def storm() -> None:
        with open_channel(ClientConfig(socket=socket)) as channel:
            stub = pb_grpc.TableServiceStub(channel)
            while time.monotonic() < deadline:
                with lock:
                    folder = next(turns)
                os.utime(sorted(folder.glob("*.safetensors"))[0])
                request = pb.AttachRequest(set_id="0" * 20, checkpoint=str(folder), pid=os.getpid())
                call = stub.Attach(request, timeout=60)
                try:
                    next(iter(call))
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                call.cancel()
                with lock:
                    codes[code] += 1

    workers = [threading.Thread(target=storm) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"attaches": sum(codes.values()), "codes": dict(codes)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
