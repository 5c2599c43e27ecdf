"""engramd.v1.TableService: attach (a lease held by an open stream), status, fallback reports."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from engramd.api.wire import (
    PROGRESS_INTERVAL_S,
    attachment,
    handle_kinds,
    kind_names,
    load_progress,
    status_reply,
)
from engramd.backings import Backing
from engramd.backings.handles import HandleKind
from engramd.config import DaemonConfig
from engramd.errors import abort
from engramd.host.blocking import BlockingPool
from engramd.sets.leases import ON_FD_CHANNEL, Lease
from engramd.sets.loader import LoadProgress
from engramd.sets.plans import PlanCache
from engramd.sets.policy import LoadPolicy, checkpoint_open_to_group, open_to_group, resolve
from engramd.sets.proof import Prover
from engramd.sets.store import SetStore
from engramd.sets.tableset import SetState, TableSet
from engramd.units import gib
from engramd_shared.beneath import OutsideRoot, Root
from engramd_shared.checkpoint import TablePlan, is_set_id, set_id_of
from engramd_shared.errors import (
    CAUSES,
    CheckpointError,
    FingerprintMismatch,
    InvalidRequest,
    NotAllowed,
    UnknownSet,
)
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

log = logging.getLogger("engramd")

# Kubernetes' label rules: a worker's labels stay small and print safely.
_MAX_LABELS = 16
_LABEL_KEY = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9._-]{0,63}$")
_MAX_PATH = 4096
_NONCE = re.compile(r"^([0-9a-f]{32})?$")
_DEVICE = re.compile(r"^(cuda:\d{1,3})?$")
# Reads of workers' checkpoints (headers, samples) at once; they may hang on a
# network mount, so they never share threads with the daemon's own work.
_CHECKPOINT_READERS = 8
_PROVERS = 2
_CHECKERS = 4
#: Handle kinds of GPU-readable cuMem allocations: only workers with a device accept them.
CUDA_KINDS = frozenset({HandleKind.CUMEM, HandleKind.CUMEM_FABRIC})
#: Handle kinds a worker maps by path, with no credentials the daemon could check.
PATH_KINDS = frozenset({HandleKind.SHM})


class TableService(pb_grpc.TableServiceServicer):
    """Serves attaches and status from a SetStore."""

    def __init__(
        self,
        config: DaemonConfig,
        store: SetStore,
        ready: Callable[[], bool],
        group: int | None = None,
    ) -> None:
        """Serve `store`; `group` is the socket's group (it judges what status shows)."""
        self._config = config
        self._group = group
        self._store = store
        self._ready = ready
        self._started = time.monotonic()
        self._policy = LoadPolicy(config)
        self._readers = BlockingPool("checkpoint", _CHECKPOINT_READERS)
        # Kept plans and proofs by identity: stats only, never behind the readers, which
        # one member's checkpoints (huge headers, a hung mount) may hold for long.
        self._checks = BlockingPool("checkpoint-checks", _CHECKERS)
        #: The daemon's plans of checkpoints: workers attaching together name the same one.
        self.plans = PlanCache()
        # Digests of workers' copies read every selected byte, as loads do: as
        # few at once as the daemon's own loads.
        self._provers = BlockingPool("prove", _PROVERS)
        #: The daemon's one prover: digests it keeps serve attaches, loads and start-up.
        self.prover = Prover()

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttachEvent]:
        """Wait for the set to be ready, hand out its handles, hold the lease."""
        try:
            _validate(request)
            # Refused before any load when no backing could serve the worker.
            self._handle_kind(request, self._store.backings)
            ts, plan = await self._resolve(request)
            async for progress in load_progress(ts):
                yield pb.AttachEvent(progress=progress)
            if ts.error is not None:
                raise ts.error
            if plan is not None:
                try:
                    async for progress in self._prove(ts, plan):
                        yield pb.AttachEvent(progress=progress)
                except FingerprintMismatch:
                    twin = await self._twin(ts, plan, request)
                    if twin is None:
                        raise
                    ts = twin
                    async for progress in load_progress(ts):
                        yield pb.AttachEvent(progress=progress)
                    if ts.error is not None:
                        raise ts.error from None
                    async for progress in self._prove(ts, plan):
                        yield pb.AttachEvent(progress=progress)
            kind = self._handle_kind(request, [ts.backing], ts)
            route = self._gpu_route(request, ts.backing, kind)
            lease = self._store.leases.add(ts, request, kind, route)
            if plan is not None:
                # The files the plan read and the proof judged, held open: the fd
                # channel judges the peer against these, never a path again.
                lease.readers = tuple(plan.held.get(f.path) or f.path for f in plan.sources)
        except Exception as e:
            self._store.leases.stats.attach(ok=False)
            await abort(context, e)
            return
        self._store.leases.stats.attach(ok=True)
        try:
            # The files a lease was proven with are told only where every member of the
            # group may read them: the kernel names the caller only on the fd channel.
            reveal = ts.published or await self._readers.run(
                open_to_group, lease.readers, self._group
            )
            yield pb.AttachEvent(attached=self._attachment(ts, lease, kind, reveal))
            await lease.ended.wait()
            if lease.draining:
                yield pb.AttachEvent(draining=pb.Draining())
        finally:
            self._store.leases.end(lease)

    @staticmethod
    def _handle_kind(
        request: pb.AttachRequest, backings: list[Backing], ts: TableSet | None = None
    ) -> HandleKind:
        """The first kind the worker accepts that one of `backings` has (for set `ts`).

        Paths are handed out for sets the operator published only: other sets'
        files are owner-only, and go out as descriptors over the fd channel,
        which checks the peer's uid may read the checkpoint.
        """
        accepted = handle_kinds(request.accept) if request.accept else [HandleKind.SHM]
        offered: frozenset[HandleKind] = frozenset().union(*(b.handle_kinds for b in backings))
        if ts is not None and not ts.published:
            offered -= PATH_KINDS
            if not offered & set(accepted) and PATH_KINDS & set(accepted):
                raise NotAllowed(
                    f"set {ts.set_id} was loaded by a worker's attach, not published by the "
                    "operator: it is handed out only as descriptors over the fd channel (which "
                    "checks the caller may read the checkpoint), never by path; accept fd "
                    "(ENGRAMD_HANDLES), or have the operator load it (engramd load)"
                )
        for kind in accepted:
            if kind in offered:
                return kind
        names = kind_names(offered)
        if offered <= CUDA_KINDS:
            raise InvalidRequest(
                f"this daemon's {'/'.join(b.name for b in backings)} sets are cuMem allocations "
                f"({names}), handed out to workers with a CUDA device only; attach with "
                "device='cuda:N' (ENGRAMD_DEVICE)"
            )
        raise InvalidRequest(
            f"this daemon's {'/'.join(b.name for b in backings)} sets are handed out as "
            f"{names}; the request accepts none of them (upgrade the worker's engramd_client)"
        )

    def _gpu_route(self, request: pb.AttachRequest, backing: Backing, kind: HandleKind) -> int:
        """How the worker will read the set on its device, as the daemon allows it."""
        if not request.device:
            return pb.GPU_ROUTE_UNSPECIFIED
        if kind in CUDA_KINDS:
            return pb.GPU_ROUTE_CUMEM_IMPORT
        if request.gpu_route in (pb.GPU_ROUTE_REGISTER_READ_ONLY, pb.GPU_ROUTE_HOST_PAGE_TABLES):
            return request.gpu_route
        if (
            request.gpu_route == pb.GPU_ROUTE_REGISTER_WRITABLE
            and self._config.allow_writable_gpu_mappings
            and kind is HandleKind.FD
            and backing.writable_descriptors
        ):
            log.warning(
                "pid %d (as claimed; %s) gets writable descriptors of set %s: it says its GPU "
                "cannot register read-only memory (--allow-writable-gpu-mappings); "
                "`engramd verify %s` finds any write",
                request.pid,
                request.device,
                request.set_id,
                request.set_id,
            )
            return pb.GPU_ROUTE_REGISTER_WRITABLE
        return pb.GPU_ROUTE_UNSPECIFIED

    async def _resolve(self, request: pb.AttachRequest) -> tuple[TableSet, TablePlan | None]:
        """The set a request attaches, and the worker's plan of its checkpoint (if it named one).

        A bare set id attaches only a set the operator loaded: this socket
        cannot tell who asks (grpcio gives no peer credentials), so a set a
        worker's attach loaded is attached with its checkpoint, and proven.
        """
        node = self._store.sets.copy_node_for(
            request.numa_node if request.HasField("numa_node") else None
        )
        ts = self._store.sets.get(request.set_id, node)
        held = self._store.sets.get(request.set_id)
        if not request.checkpoint and not self._store.sets.published(request.set_id):
            # The same answer as for an id the daemon does not hold at all.
            held = ts = None
        plan = None
        if request.checkpoint and held is not None and held.state is not SetState.FAILED:
            plan = await self._plan_for_held(request, held)
        if ts is not None and ts.state is not SetState.FAILED:
            return ts, plan
        if held is not None and held.manifest is not None:
            # A copy on another node (--numa per-node).
            return await self._store.copy_for(held, node, self._readers), plan
        if request.reattach or not request.checkpoint:
            if ts is not None and ts.error is not None:
                raise ts.error
            raise UnknownSet(
                f"engramd holds no set {request.set_id} it may attach by id; attach with the "
                "checkpoint folder, or have the operator load it (--checkpoint, engramd load)"
            )
        loaded = [s.checkpoint for s in self._store.sets.all() if s.state is not SetState.FAILED]
        path, beneath = self._policy.check_request(request, loaded)
        plan = await self._planned(path, self._policy.selection(request), beneath)
        self._policy.check_plan(path, plan, request.set_id)
        charges = await self._checks.run(_charges, plan)
        return await self._store.ensure(plan, node, charges), plan

    async def _plan_for_held(self, request: pb.AttachRequest, held: TableSet) -> TablePlan:
        """The worker's plan of its checkpoint, for a set the daemon holds under its id.

        The daemon reads the worker's files as a load would: its own
        checkpoint's path, a configured one, or one under an allowed root.
        """
        path, beneath = self._policy.beneath(request.checkpoint) or (
            resolve(request.checkpoint),
            None,
        )
        if beneath is None and str(path) != held.checkpoint:
            path, beneath = self._policy.check_read(request.checkpoint)
        plan = await self._planned(path, held.selection, beneath)
        if str(plan.checkpoint) != held.checkpoint:
            self._policy.check_plan(path, plan, request.set_id)
        elif plan.set_id != request.set_id:
            raise FingerprintMismatch(
                f"the daemon's view of {path} differs from the worker's: the files' names, "
                "sizes, headers or data differ; give the daemon and the worker the same checkpoint"
            )
        return plan

    async def _twin(
        self, ts: TableSet, plan: TablePlan, request: pb.AttachRequest
    ) -> TableSet | None:
        """The set of the worker's own bytes, where they differ from the set held under its id.

        Two checkpoints that share headers and samples but not every byte
        share a set id: one loaded first must not deny the other (a planted
        twin would shut out the clean copy). A worker's files under an allowed
        root that the held set's own files are not get a set of their own,
        named by the set id and the files' identities, within their owner's
        share; None where that does not apply (the set's own files changed, a
        configured checkpoint, a re-attach), and the refusal stands.
        """
        assert ts.manifest is not None
        loaded = {s.path for s in ts.manifest.sources}
        if request.reattach or not plan.held or any(s.path in loaded for s in plan.sources):
            return None
        files = ",".join(f"{s.dev}:{s.ino}:{s.ctime_ns}" for s in plan.sources)
        own = dataclasses.replace(plan, set_id=set_id_of(f"{plan.fingerprint}:{files}"))
        log.info(
            "the files of %s hold other bytes than set %s under its id: they get set %s",
            plan.checkpoint,
            ts.set_id,
            own.set_id,
        )
        charges = await self._checks.run(_charges, plan)
        return await self._store.ensure(own, ts.node, charges)

    async def _planned(self, path: Path, selection: str, beneath: Root | None) -> TablePlan:
        """The plan of a worker's checkpoint: kept (checked off the readers), or read now."""
        kept = await self._checks.run(self.plans.kept, path, selection, beneath)
        if kept is not None:
            return kept
        return await self._readers.run(self._plan, path, selection, beneath)

    def _plan(self, path: Path, selection: str, beneath: Root | None) -> TablePlan:
        """The plan of a worker's checkpoint (on a reader thread), its errors told only to
        those who could see what they name.

        The worker socket cannot tell who asks: an error about a checkpoint
        not every member of the socket group may read (a size, a header's
        length, its first bytes) goes to the daemon's log, and the caller
        learns only that the checkpoint is unusable.
        """
        try:
            return self.plans.plan(path, selection, beneath)
        except OutsideRoot:
            raise
        except CheckpointError as e:
            if beneath is None or checkpoint_open_to_group(path, beneath, self._group):
                raise
            log.info("a worker's checkpoint %s cannot be used: %s", path, e)
            raise CheckpointError(
                f"engramd cannot use the checkpoint at {path} (a file is missing, unreadable or "
                "not safetensors); its files are not open to every member of the socket group, "
                "so the daemon's log alone names the problem; the worker's own read of its "
                "files (engramd_client.plan_tables) names it too"
            ) from None

    async def _prove(self, ts: TableSet, plan: TablePlan) -> AsyncIterator[pb.LoadProgress]:
        """Progress of proving the worker's files hold the set's bytes; raises when they do not."""
        assert ts.manifest is not None
        proof = await self._checks.run(self.prover.judge, plan, ts.manifest)
        if not proof.unproven:
            return
        progress = LoadProgress(proof.nbytes)
        if not proof.nbytes:
            # Every digest is kept: a comparison, no reads, no wait behind digests.
            await self._checks.run(self.prover.prove, proof, ts.manifest, progress)
            return
        task = asyncio.ensure_future(
            self._provers.run(self.prover.prove, proof, ts.manifest, progress)
        )
        # Its outcome is read below, or lost with a worker that hung up.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while not task.done():
                yield pb.LoadProgress(bytes_done=progress.done, bytes_total=progress.total)
                await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S)
        finally:
            # A worker that hangs up stops the digest at its next progress step.
            progress.cancel.set()
        task.result()

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
            return self.status(await self._group_readable())
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
        self._store.leases.stats.fallback(request.cause)
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
            self._store,
            self._config.socket,
            time.monotonic() - self._started,
            self._ready(),
            self._config.allow_writable_gpu_mappings,
            shown,
            self._config.worker_share_per_uid,
            self._config.worker_set_grace,
        )

    async def _group_readable(self) -> Callable[[TableSet], bool]:
        """Which sets the worker socket shows in full.

        The modes are read on the checkpoint readers' threads: a checkpoint's
        folder may sit on a network mount that hangs, and the event loop
        serves every other call.
        """
        pending = {
            ts.key: [s.path for s in ts.manifest.sources] if ts.manifest else [ts.checkpoint]
            for ts in self._store.sets.all()
            if not ts.published
        }
        readable = await self._readers.run(
            lambda: {key for key, files in pending.items() if open_to_group(files, self._group)}
        )
        return lambda ts: ts.published or ts.key in readable


def _charges(plan: TablePlan) -> dict[int, int]:
    """A worker's load: its bytes by the uid that owns the files they come from (held open).

    Files of root and of the daemon's own user are the operator's: charged to no one.
    """
    operator = {0, os.geteuid()}
    charges: dict[int, int] = {}
    # Span by span: a joined table's shards may lie in files of different owners.
    for span in (p for t in plan.tensors for p in t.spans):
        held = plan.held.get(str(span.file))
        uid = held.file.stat().st_uid if held is not None else 0
        if uid not in operator:
            charges[uid] = charges.get(uid, 0) + span.nbytes
    return charges


def _validate(request: pb.AttachRequest) -> None:
    if not is_set_id(request.set_id):
        raise InvalidRequest(f"set_id {request.set_id[:64]!r} is not a set id (20 hex digits)")
    if len(request.checkpoint) > _MAX_PATH or len(request.tensors) > _MAX_PATH:
        raise InvalidRequest("checkpoint or tensors is longer than 4096 characters")
    if "\0" in request.checkpoint or "\0" in request.tensors:
        raise InvalidRequest("checkpoint or tensors holds a NUL character")
    if request.pid < 0:
        raise InvalidRequest(f"pid {request.pid} is negative")
    if not _NONCE.match(request.nonce):
        raise InvalidRequest("nonce is not 32 hex digits")
    if not _DEVICE.match(request.device):
        raise InvalidRequest("device is not cuda:N (or empty)")
    if request.gpu_route not in pb.GpuRoute.values():
        raise InvalidRequest(f"gpu_route {request.gpu_route} is not an engramd.v1.GpuRoute")
    if len(request.labels) > _MAX_LABELS or not all(
        _LABEL_KEY.match(k) and _LABEL_VALUE.match(v) for k, v in request.labels.items()
    ):
        raise InvalidRequest(
            f"labels: at most {_MAX_LABELS}, keys of 1 to 63 and values of up to 63 characters "
            "of A-Z a-z 0-9 . _ - (Kubernetes' label rules)"
        )
