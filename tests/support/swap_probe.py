"""Swap a file and a symlink under one name while attaching for descriptors; print one line.

    python tests/support/swap_probe.py SOCKET SET_ID FOLDER NAME DECOY ROUNDS SECONDS

First ROUNDS times in a fixed order: FOLDER/NAME made the symlink to another
user's file (FOLDER/DECOY), FOLDER attached with SET_ID (the daemon plans and
proves that user's file), the two names traded back (renameat2
RENAME_EXCHANGE) so that FOLDER/NAME is the caller's own file, and only then
the descriptors collected over the fd channel: the window in which a check of
the path instead of the files the daemon holds would hand them out. Then the
two trade places in a loop in a child process while this one attaches again
and again, for SECONDS at most. Prints {"won": attempts} once the fd channel
hands out a descriptor, else {"attempts": n, "outcomes": {outcome: count},
"exchanged": {outcome: count}} (the ordered rounds' outcomes). Run as the
user who owns FOLDER (tests/support/run_as.py).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

import grpc

from engramd.testing.child import say
from engramd_client import EngramdError
from engramd_client.fdchannel import collect
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> None:
    """Trade the names `a` and `b` in one step."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), f"renameat2 {a} {b}")


def _swap_forever(a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    while True:
        libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE)


def _attempt(
    stub: pb_grpc.TableServiceStub,
    set_id: str,
    folder: str,
    outcomes: collections.Counter[str],
    before_collect: Callable[[], None] = lambda: None,
) -> bool:
    """Attach `folder` for descriptors; True when they were handed out (else the outcome is
    counted). `before_collect` runs between the attached event and the fd channel."""
    request = pb.AttachRequest(
        set_id=set_id, checkpoint=folder, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD]
    )
    call = stub.Attach(request, timeout=30)
    try:
        attached = next(e for e in call if e.WhichOneof("event") == "attached")
        before_collect()
        fds = collect(
            attached.attached.fd_channel.socket,
            attached.attached.lease_id,
            attached.attached.fd_channel.secret,
            10,
        )
    except grpc.RpcError as e:
        outcomes[f"{e.code().name}: {(e.details() or '')[:60]}"] += 1
        return False
    except EngramdError as e:
        outcomes[f"{type(e).__name__}: {str(e)[:70]}"] += 1
        return False
    finally:
        call.cancel()
    for fd in fds.values():
        os.close(fd)
    return True


def main() -> int:
    socket, set_id, folder, name, decoy, rounds, seconds = sys.argv[1:8]
    own, other = os.path.join(folder, name), os.path.join(folder, decoy)
    exchanged: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    attempts = 0
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.TableServiceStub(channel)
        for _ in range(int(rounds)):
            attempts += 1
            _exchange(own, other)  # NAME: the symlink to the other user's file
            try:
                won = _attempt(stub, set_id, folder, exchanged, lambda: _exchange(own, other))
            finally:
                if os.path.islink(own):  # refused before the exchange back
                    _exchange(own, other)
            if won:
                say({"won": attempts})
                return 0
        child = os.fork()
        if child == 0:
            _swap_forever(own, other)
        deadline = time.monotonic() + float(seconds)
        try:
            while time.monotonic() < deadline:
                attempts += 1
                if _attempt(stub, set_id, folder, outcomes):
                    say({"won": attempts})
                    return 0
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    say({"attempts": attempts, "outcomes": dict(outcomes), "exchanged": dict(exchanged)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
