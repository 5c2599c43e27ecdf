"""engramd.v1.AdminService: load, drop, verify, status. Served only on the admin socket (0600).

Translates each call to the verbs of the node's sets (engramd.sets.keeper).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc

from engramd.api.requests import load_intent
from engramd.api.wire import progress, set_info
from engramd.errors import abort
from engramd.sets.intents import Loaded
from engramd.sets.keeper import SetKeeper
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

log = logging.getLogger("engramd")

#: Who asks on the admin socket (0600): grpcio names no peer, the socket's mode does.
ASKER = "asked on the admin socket by engramd's user or root"


class AdminService(pb_grpc.AdminServiceServicer):
    """What only the daemon's owner may ask for."""

    def __init__(self, sets: SetKeeper, status: Callable[[], pb.StatusReply]) -> None:
        """Serve `sets`; `status()` is the full status reply (every set shown)."""
        self._sets = sets
        self._status = status

    async def Load(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadEvent]:
        """Load a checkpoint's set (a copy per node, --numa per-node); progress, then the set."""
        loaded: Loaded | None = None
        try:
            async for step in self._sets.load(load_intent(request)):
                if isinstance(step, Loaded):
                    loaded = step
                else:
                    yield pb.LoadEvent(progress=progress(step))
            assert loaded is not None
        except Exception as e:
            log.warning("load of %s failed (%s): %s", request.checkpoint, ASKER, e)
            await abort(context, e)
            return
        yield pb.LoadEvent(ready=set_info(loaded.ts))

    async def Drop(
        self, request: pb.DropRequest, context: grpc.aio.ServicerContext
    ) -> pb.DropReply:
        """Unlink a set."""
        try:
            nbytes, leases = await self._sets.drop(request.set_id, request.force)
        except Exception as e:
            log.warning("drop of set %s failed (%s): %s", request.set_id, ASKER, e)
            await abort(context, e)
            raise
        return pb.DropReply(bytes=nbytes, leases=leases)

    async def Verify(
        self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyReply:
        """Recompute a set's checksums; name the tensors that differ (their copy is then
        served no more, and its workers told it is stale)."""
        try:
            verified = await self._sets.verify(request.set_id)
        except Exception as e:
            log.warning("verify of set %s failed (%s): %s", request.set_id, ASKER, e)
            await abort(context, e)
            raise
        ts, corrupted = verified.ts, verified.corrupted
        if corrupted:
            log.error(
                "verify of set %s (%s): %d of %d tensors differ from their checksums (%s); "
                "engramd hands out that copy no more; leases told it is stale: %d; %s",
                request.set_id,
                ASKER,
                len(corrupted),
                ts.ntensors,
                ", ".join(corrupted),
                verified.told,
                verified.fix or "it was dropped or loaded again meanwhile",
            )
        else:
            log.info(
                "verified set %s (%s): all %d tensors match", request.set_id, ASKER, ts.ntensors
            )
        return pb.VerifyReply(
            tensors=ts.ntensors,
            bytes=ts.nbytes,
            corrupted=corrupted,
            stale_leases=verified.told,
            fix=verified.fix,
        )

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """What the node holds, every set in full (the owner may see what workers may not)."""
        try:
            return self._status()
        except Exception as e:
            await abort(context, e)
            raise
