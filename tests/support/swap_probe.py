"""Swap a file and a symlink under one name while attaching for descriptors; print one line.

    python tests/support/swap_probe.py SOCKET SET_ID FOLDER NAME DECOY SECONDS

FOLDER/NAME and FOLDER/DECOY (a symlink to another user's file) trade places
in a loop (renameat2 RENAME_EXCHANGE) in a child process, while this one
attaches FOLDER with SET_ID for descriptors again and again, for SECONDS at
most. Prints {"won": attempts} once the fd channel hands out a descriptor,
else {"attempts": n, "outcomes": {outcome: count}}. Run as the user who owns
FOLDER (tests/support/run_as.py).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import sys
import time

import grpc

from engramd.testing.child import say
from engramd_client import EngramdError
from engramd_client.fdchannel import collect
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _swap_forever(a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    while True:
        libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE)


def main() -> int:
    socket, set_id, folder, name, decoy, seconds = sys.argv[1:7]
    child = os.fork()
    if child == 0:
        _swap_forever(os.path.join(folder, name), os.path.join(folder, decoy))
    outcomes: collections.Counter[str] = collections.Counter()
    attempts = 0
    deadline = time.monotonic() + float(seconds)
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.TableServiceStub(channel)
            while time.monotonic() < deadline:
                attempts += 1
                request = pb.AttachRequest(
                    set_id=set_id, checkpoint=folder, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD]
                )
                call = stub.Attach(request, timeout=30)
                try:
                    attached = next(e for e in call if e.WhichOneof("event") == "attached")
                    fds = collect(
                        attached.attached.fd_channel.socket,
                        attached.attached.lease_id,
                        attached.attached.fd_channel.secret,
                        10,
                    )
                except grpc.RpcError as e:
                    outcomes[f"{e.code().name}: {(e.details() or '')[:60]}"] += 1
                    continue
                except EngramdError as e:
                    outcomes[f"{type(e).__name__}: {str(e)[:70]}"] += 1
                    continue
                finally:
                    call.cancel()
                for fd in fds.values():
                    os.close(fd)
                say({"won": attempts})
                return 0
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    say({"attempts": attempts, "outcomes": dict(outcomes)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
