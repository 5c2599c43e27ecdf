"""engramd.v1.AdminService: load, drop, verify, status. Served only on the admin socket (0600)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from engramd.api.wire import load_progress, set_info
from engramd.config import DaemonConfig
from engramd.errors import abort
from engramd.host.blocking import BlockingPool
from engramd.sets.loader import LoadProgress
from engramd.sets.proof import Prover
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd_shared.checkpoint import TablePlan, plan_tables
from engramd_shared.errors import InvalidRequest
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc


class AdminService(pb_grpc.AdminServiceServicer):
    """What only the daemon's owner may ask for."""

    def __init__(
        self,
        config: DaemonConfig,
        store: SetStore,
        status: Callable[[], pb.StatusReply],
        prover: Prover,
    ) -> None:
        """Serve `store`; `prover` is the daemon's one (its kept digests serve every caller)."""
        self._config = config
        self._store = store
        self._status = status
        self._readers = BlockingPool("admin-checkpoint", 2)
        self._prover = prover

    async def Load(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadEvent]:
        """Load a checkpoint's set (a copy per node, --numa per-node); progress, then the set."""
        try:
            if not request.checkpoint:
                raise InvalidRequest("checkpoint is empty; name a checkpoint folder")
            plan = await self._readers.run(
                plan_tables, request.checkpoint, request.tensors or self._config.tensors
            )
            copies = await self._store.ensure_everywhere(plan)
            for ts in copies:
                async for progress in load_progress(ts):
                    yield pb.LoadEvent(progress=progress)
                if ts.error is not None:
                    raise ts.error
                # A set held under this id may come from other files (a worker's
                # copy): it is published for all only for bytes proven equal.
                await self._readers.run(self._prove, plan, ts)
            self._store.publish(copies)
        except Exception as e:
            await abort(context, e)
            return
        yield pb.LoadEvent(ready=set_info(copies[0]))

    def _prove(self, plan: TablePlan, ts: TableSet) -> None:
        assert ts.manifest is not None
        proof = self._prover.judge(plan, ts.manifest)
        self._prover.prove(proof, ts.manifest, LoadProgress(proof.nbytes))

    async def Drop(
        self, request: pb.DropRequest, context: grpc.aio.ServicerContext
    ) -> pb.DropReply:
        """Unlink a set."""
        try:
            nbytes, leases = await self._store.drop(request.set_id, request.force)
        except Exception as e:
            await abort(context, e)
            raise
        return pb.DropReply(bytes=nbytes, leases=leases)

    async def Verify(
        self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyReply:
        """Recompute a set's checksums; name the tensors that differ."""
        try:
            ts, corrupted = await self._store.verify(request.set_id)
        except Exception as e:
            await abort(context, e)
            raise
        return pb.VerifyReply(tensors=ts.ntensors, bytes=ts.nbytes, corrupted=corrupted)

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """What the node holds, every set in full (the owner may see what workers may not)."""
        try:
            return self._status()
        except Exception as e:
            await abort(context, e)
            raise
