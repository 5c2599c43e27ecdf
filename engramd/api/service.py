"""engramd.v1.TableService: attach (a lease held by an open stream), status, fallback reports.

Translates each call to the verbs of the node's sets (engramd.sets.keeper)
and their answers back to messages; the sets decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from engramd.api.requests import attach_intent
from engramd.api.wire import attachment, progress, status_reply
from engramd.backings.handles import HandleKind
from engramd.config import DaemonConfig
from engramd.errors import abort
from engramd.sets.intents import Granted
from engramd.sets.keeper import SetKeeper
from engramd.sets.leases import ON_FD_CHANNEL, Lease
from engramd.sets.tableset import SetState, TableSet
from engramd.units import gib
from engramd_shared.checkpoint import is_set_id
from engramd_shared.errors import CAUSES, InvalidRequest
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

log = logging.getLogger("engramd")


class TableService(pb_grpc.TableServiceServicer):
    """Serves attaches and status from the node's sets."""

    def __init__(self, config: DaemonConfig, sets: SetKeeper) -> None:
        """Serve `sets` on the worker socket."""
        self._config = config
        self._sets = sets
        self._started = time.monotonic()

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttachEvent]:
        """Wait for the set to be ready, hand out its handles, hold the lease (telling the
        worker if its copy fails verification meanwhile)."""
        granted: Granted | None = None
        try:
            # Closed at once when the worker hangs up: a proof in progress stops.
            async with contextlib.aclosing(self._sets.attach(attach_intent(request))) as steps:
                async for step in steps:
                    if isinstance(step, Granted):
                        granted = step
                    else:
                        yield pb.AttachEvent(progress=progress(step))
            assert granted is not None
        except Exception as e:
            self._sets.stats.attach(ok=False)
            await abort(context, e)
            return
        self._sets.stats.attach(ok=True)
        ts, lease, kind = granted.ts, granted.lease, granted.kind
        try:
            yield pb.AttachEvent(attached=self._attachment(ts, lease, kind, granted.reveal_sources))
            if await _told_stale(lease):
                yield pb.AttachEvent(stale=_stale(ts))
                await lease.ended.wait()
            if lease.draining:
                yield pb.AttachEvent(draining=pb.Draining())
        finally:
            self._sets.leases.end(lease)
            # The last lease of a replaced generation: its copy goes.
            self._sets.store.retire_replaced()

    def _attachment(
        self, ts: TableSet, lease: Lease, kind: HandleKind, sources: bool
    ) -> pb.Attachment:
        assert ts.manifest is not None
        fd_socket = self._config.fd_socket if kind in ON_FD_CHANNEL else None
        return attachment(ts, lease, ts.backing.handles(ts.manifest, kind), fd_socket, sources)

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """What the node holds, as any member of the socket group may see it."""
        try:
            return self.status(await self._sets.shown_to_group())
        except Exception as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e

    async def ReportFallback(
        self, request: pb.FallbackReport, context: grpc.aio.ServicerContext
    ) -> pb.FallbackAck:
        """Count a worker's fallback to private tables by cause (known causes only)."""
        if request.cause not in CAUSES or not (request.set_id == "" or is_set_id(request.set_id)):
            await abort(
                context,
                InvalidRequest(
                    f"cause must be one of {', '.join(sorted(CAUSES))} and set_id a set id"
                ),
            )
        self._sets.stats.fallback(request.cause)
        log.info(
            "pid %d fell back to private tables (%s, set %s, %s)",
            request.pid,
            request.cause,
            request.set_id,
            gib(request.bytes),
        )
        return pb.FallbackAck()

    def status(self, shown: Callable[[TableSet], bool] | None = None) -> pb.StatusReply:
        """The status reply, built from the store (on the event loop).

        `shown` says which sets appear in full: on the worker socket, sets the
        operator loaded and sets whose files every member of the socket group
        may read; others appear with their size and state only (no id, path or
        leases), since a caller there may be any member of the group and the
        daemon cannot tell which (grpcio gives no peer credentials). None, for
        the owner's admin socket, shows every set.
        """
        return status_reply(
            self._sets.store,
            self._config.socket,
            time.monotonic() - self._started,
            self._sets.store.ready,
            self._config.allow_writable_gpu_mappings,
            shown,
            self._config.worker_share_per_uid,
            self._config.worker_set_grace,
            self._sets.failed_configured(),
            self._sets.fallbacks.scan(),
            self._sets.configured_ids(),
        )


def _stale(ts: TableSet) -> pb.Stale:
    """What a lease of `ts` is told: its copy failed verification, or a later generation
    replaced it (the worker moves there at a step boundary)."""
    if ts.state is SetState.FAILED_VERIFICATION or not ts.replaced_by:
        return pb.Stale(reason=str(ts.error), tensors=ts.changed)
    return pb.Stale(
        reason=(
            f"set {ts.set_id} (generation {ts.generation}) is replaced by set {ts.replaced_by} "
            f"(generation {ts.generation + 1}), which the operator loaded"
        ),
        next_set_id=ts.replaced_by,
        next_generation=ts.generation + 1,
    )


async def _told_stale(lease: Lease) -> bool:
    """Wait until the lease ends or its copy fails verification; True for the latter."""
    waits = [asyncio.ensure_future(e.wait()) for e in (lease.ended, lease.told_stale)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return lease.told_stale.is_set() and not lease.ended.is_set()
