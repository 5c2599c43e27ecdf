"""Attach claiming pid 1 (its pid namespace and start time), and print how status shows it.

    python tests/support/claim_probe.py SOCKET

Prints "pid=P pid_verified=B uid=U" for its own lease ("unknown" where
status has no uid), then ends the lease. Run as another user
(tests/support/run_as.py): any user can read pid 1's start time, so the claim is
one anyone can make.
"""

from __future__ import annotations

import sys

from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from engramd_shared.process import pid_namespace, start_ticks


def main() -> int:
    with open_channel(ClientConfig(socket=sys.argv[1])) as channel:
        stub = pb_grpc.TableServiceStub(channel)
        [held] = stub.Status(pb.StatusRequest(), timeout=10).sets
        request = pb.AttachRequest(
            set_id=held.set_id,
            pid=1,
            pid_namespace=pid_namespace(),
            pid_start=start_ticks(1) or 0,
            accept=[pb.HANDLE_KIND_SHM],
        )
        call = stub.Attach(request, timeout=60)
        try:
            attached = next(e for e in call if e.WhichOneof("event") == "attached").attached
            status = stub.Status(pb.StatusRequest(), timeout=10)
            [lease] = [x for s in status.sets for x in s.leases if x.lease_id == attached.lease_id]
            uid = str(lease.uid) if lease.HasField("uid") else "unknown"
            print(f"pid={lease.pid} pid_verified={lease.pid_verified} uid={uid}")
        finally:
            call.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
