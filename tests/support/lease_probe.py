"""Attach a checkpoint by name over the raw protocol, collect its descriptors, print one line.

    python tests/support/lease_probe.py SOCKET SET_ID CHECKPOINT

Names the checkpoint without planning it first (a user who cannot read the
folder can still name it), accepts descriptors only, holds the lease while
it collects them from the fd channel the attachment names. Prints
{"files": [...]} or {"error": class or status name, "message": ...}, with
"sources" (the checkpoint files the attachment named) once attached. Run
as another user (tests/support/run_as.py) to see what the daemon grants that user.
"""

from __future__ import annotations

import os
import sys

import grpc

from engramd.testing.child import say
from engramd_client import EngramdError
from engramd_client.fdchannel import collect
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc


def main() -> int:
    socket, set_id, checkpoint = sys.argv[1:4]
    request = pb.AttachRequest(
        set_id=set_id, checkpoint=checkpoint, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD]
    )
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        call = pb_grpc.TableServiceStub(channel).Attach(request, timeout=60)
        try:
            attached = next(e for e in call if e.WhichOneof("event") == "attached").attached
        except grpc.RpcError as e:
            say({"error": e.code().name, "message": e.details()})
            return 0
        sources = [s.path for s in attached.sources]
        try:
            fds = collect(
                attached.fd_channel.socket, attached.lease_id, attached.fd_channel.secret, 10
            )
        except EngramdError as e:
            say({"error": type(e).__name__, "message": str(e), "sources": sources})
            return 0
        finally:
            call.cancel()
    for fd in fds.values():
        os.close(fd)
    say({"files": sorted(fds), "sources": sources})
    return 0


if __name__ == "__main__":
    sys.exit(main())
