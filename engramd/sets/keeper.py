"""The node's sets from first plan to last lease: the one place a set is planned, loaded,
proven and published, whoever asks (start-up, the operator, a worker).

`SetKeeper` owns the store (sets, admission, leases), the plans of
checkpoints, the prover and the threads that read checkpoints; the api/
translates its callers' messages to its verbs:

  load_configured()          start-up: adopt what the backing holds, load --checkpoint
  load(intent)               `engramd load`: progress, then the published set
  attach(intent)             a worker's attach: progress, then the set and a lease
  drop(set_id, force)        `engramd drop`
  verify(set_id)             `engramd verify`: a copy with changed bytes is served no more
  shown_to_group()           which sets the worker socket's status shows in full
  sweep(), close()           the lifecycle's upkeep and shutdown

The fd channel redeems a lease's secret with `leases.redeem()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from engramd.backings import Backing
from engramd.backings.handles import HandleKind
from engramd.config import DaemonConfig
from engramd.host.blocking import BlockingPool
from engramd.sets.fallbacks import FallbackBook
from engramd.sets.generations import replaced_by_load, succeed
from engramd.sets.intents import (
    AttachIntent,
    GpuRoute,
    Granted,
    Loaded,
    LoadIntent,
    Progress,
    Verified,
)
from engramd.sets.leases import LeaseBook, Stats, check_served
from engramd.sets.loader import LoadProgress
from engramd.sets.plans import PlanCache
from engramd.sets.policy import LoadPolicy, checkpoint_open_to_group, open_to_group, resolve
from engramd.sets.proof import Prover
from engramd.sets.seams import Attestor, Remote, StoreUnreadable
from engramd.sets.store import SetStore, reload_fix
from engramd.sets.tableset import SetState, TableSet
from engramd_shared.beneath import OutsideRoot, Root
from engramd_shared.checkpoint import DEFAULT_TENSORS, TablePlan, is_store_url, set_id_of
from engramd_shared.errors import (
    CheckpointError,
    FingerprintMismatch,
    InvalidRequest,
    NotAllowed,
    ShareError,
    UnknownSet,
)

log = logging.getLogger("engramd")

#: How often a caller waiting for a load or a proof hears about its progress.
PROGRESS_INTERVAL_S = 0.25
#: Reads of checkpoints at once (headers, samples; the operator's and workers' alike):
#: they may hang on a network mount, so they never share threads with the daemon's own work.
CHECKPOINT_READERS = 8
#: Digests of workers' copies at once: they read every selected byte, as loads do.
PROVERS = 2
#: Kept plans and proofs checked by identity at once: stats only, never behind the
#: readers, which one member's checkpoints (huge headers, a hung mount) may hold for long.
CHECKERS = 4
#: Handle kinds of GPU-readable cuMem allocations: only workers with a device accept them.
CUDA_KINDS = frozenset({HandleKind.CUMEM, HandleKind.CUMEM_FABRIC})
#: Handle kinds a worker maps by path, with no credentials the daemon could check.
PATH_KINDS = frozenset({HandleKind.SHM})


class SetKeeper:
    """The node's sets and every verb that changes them; runs on the daemon's event loop."""

    def __init__(
        self,
        config: DaemonConfig,
        backings: list[Backing],
        remote: Remote | None = None,
        group: int | None = None,
    ) -> None:
        """Keep sets in `backings`; loads fill from `remote` first (None: the files), which
        also plans checkpoints named by URL and checks filled sets' attestations.

        `group` is the worker socket's group: what its members may all read
        is what an error or a status on that socket may name.
        """
        self._config = config
        self._group = group
        self._remote = remote
        #: The fleet's key where the daemon has one: what filled sets' attestations are
        #: checked with.
        self._attestor: Attestor | None = remote.attestor if remote is not None else None
        self.store = SetStore(
            backings,
            config.load_threads,
            config.mlock,
            memory_budget=config.memory_budget,
            evict_idle=config.evict_idle,
            adopt_grace_s=config.adopt_grace,
            max_leases=config.max_leases,
            placement=config.numa,
            leases_per_uid=config.leases_per_uid,
            worker_share_per_uid=config.worker_share_per_uid,
            fill=remote.fill if remote is not None else None,
            plan_elsewhere=remote.planner.plan if remote is not None else None,
            warm_page_cache=config.warm_page_cache,
        )
        self._policy = LoadPolicy(config)
        #: The plans of checkpoints: workers attaching together name the same one.
        self.plans = PlanCache()
        #: The one prover: the digests it keeps serve attaches, loads and start-up.
        self.prover = Prover()
        #: The threads that read checkpoints, whoever asked.
        self.readers = BlockingPool("checkpoint", CHECKPOINT_READERS)
        self._checks = BlockingPool("checkpoint-checks", CHECKERS)
        self._provers = BlockingPool("prove", PROVERS)
        # Configured checkpoints that could not be planned, with why (status shows them).
        self._unplanned: list[tuple[str, str]] = []
        # The plannings of configured checkpoints in object stores, under way.
        self._planning: set[asyncio.Task[None]] = set()
        #: The replicas that went private, from their records beside the socket.
        self.fallbacks = FallbackBook(config.socket, self.store.leases.stats)

    @property
    def leases(self) -> LeaseBook:
        """The workers' leases (the fd channel redeems their secrets there)."""
        return self.store.leases

    @property
    def stats(self) -> Stats:
        """Attaches answered and fallbacks reported, for the metrics."""
        return self.store.leases.stats

    # -- the operator's sets --------------------------------------------------

    async def load_configured(self, verifying: Callable[[str], None] | None = None) -> None:
        """Adopt what the backings hold, then start loading every --checkpoint and publish it.

        Returns once every configured set of files is loading or held; `store.settle()`
        waits for the loads. `verifying(set_id)` is called before an adopted
        set's bytes are read in full (--verify, or a proof of other files).
        A checkpoint that cannot be loaded is logged and the daemon serves the
        others; the store then never becomes ready. A checkpoint in an object
        store is planned meanwhile, on a task of its own (its store may take up
        to PLANNING_TIMEOUT_S): a slow store delays its own set, not the others
        nor the daemon's sockets.
        """
        await self.store.adopt_existing(verify=self._config.verify, verifying=verifying)
        for checkpoint in self._config.checkpoints:
            if is_store_url(checkpoint):
                self.store.configure_later()
                task = asyncio.get_running_loop().create_task(self._configure_stored(checkpoint))
                self._planning.add(task)
                task.add_done_callback(self._planning.discard)
        for checkpoint in self._config.checkpoints:
            if not is_store_url(checkpoint):
                await self._configure(checkpoint, verifying)

    async def _configure_stored(self, checkpoint: str) -> None:
        try:
            await self._configure(checkpoint, None)
        finally:
            self.store.configured_later()

    async def _configure(self, checkpoint: str, verifying: Callable[[str], None] | None) -> None:
        """Plan, load (or adopt and prove) and publish one --checkpoint; a failure is logged."""
        try:
            plan = await self._operator_plan(checkpoint, self._config.tensors)
            copies = await self.store.ensure_everywhere(plan)
            for ts in copies:
                if ts.manifest is not None:
                    # Adopted: perhaps loaded from a worker's copy under this id.
                    await self._prove_held(plan, ts, verifying)
            self._publish(plan, copies)
            self.store.configure(copies)
        except (CheckpointError, ShareError) as e:
            held = self._held_from_store(checkpoint) if isinstance(e, StoreUnreadable) else []
            if held:
                # A restart while the store is unreachable keeps serving what it held.
                log.warning(
                    "cannot plan configured checkpoint %s (%s); serving set %s held from it, "
                    "which carries the fleet's attestation",
                    checkpoint,
                    e,
                    held[0].set_id,
                )
                self.store.publish(held)
                self.store.configure(held)
                return
            # The daemon keeps serving every other set; it stays not ready
            # so the operator sees that this one is missing.
            log.error("cannot load configured checkpoint %s: %s", checkpoint, e)
            self._unplanned.append((checkpoint, str(e)))
            self.store.configure(None)

    def _held_from_store(self, checkpoint: str) -> list[TableSet]:
        """The ready copies held (adopted) of a configured checkpoint in an object store that
        did not answer, each with the fleet's attestation of its set under the configured
        selection (of the newest such set). A malformed checkpoint there is no reason to keep
        the old set."""
        held = [
            ts
            for ts in self.store.sets.all()
            if ts.checkpoint == checkpoint
            and ts.state is SetState.READY
            and ts.manifest is not None
            and ts.manifest.attestation
            and self._config.tensors in (DEFAULT_TENSORS, ts.selection)
            and self._attestor is not None
            and not self._unattested(ts)
        ]
        newest = max(held, key=lambda ts: ts.manifest.created if ts.manifest else 0.0, default=None)
        return [ts for ts in held if newest is not None and ts.set_id == newest.set_id]

    def configured_ids(self) -> set[str]:
        """The set ids of the configured checkpoints' sets (--checkpoint)."""
        named = {c if is_store_url(c) else str(Path(c).resolve()) for c in self._config.checkpoints}
        named |= set(self._config.checkpoints)
        return {ts.set_id for ts in self.store.configured} | {
            ts.set_id for ts in self.store.held() if ts.checkpoint in named
        }

    def failed_configured(self) -> list[tuple[str, str]]:
        """(checkpoint, why) for each --checkpoint that gave no ready set: it could not be
        planned, or a copy of its set failed to load."""
        failed = list(self._unplanned)
        for ts in self.store.configured:
            if ts.state is SetState.FAILED and all(c != ts.checkpoint for c, _ in failed):
                failed.append((ts.checkpoint, str(ts.error)))
        return failed

    async def load(self, intent: LoadIntent) -> AsyncGenerator[Progress | Loaded, None]:
        """Load a checkpoint's set (a copy per node with --numa per-node), prove what was held
        under its id, publish it: progress, then the set. A copy that failed verification is
        dropped and loaded again."""
        plan = await self._operator_plan(intent.checkpoint, intent.tensors or self._config.tensors)
        # Another revision's shapes are refused before a byte is loaded.
        replaced = replaced_by_load(self.store.sets, plan, intent.replaces)
        await self.store.replace_failed(plan.set_id)
        copies = await self.store.ensure_everywhere(plan)
        for ts in copies:
            async for step in load_progress(ts):
                yield step
            # A set held under this id may come from other files (a worker's
            # copy): it is published for all only for bytes proven equal.
            await self._prove_held(plan, ts)
        self._publish(plan, copies)
        replaced = [ts for ts in replaced if not ts.replaced_by and self.store.sets.holds(ts)]
        if replaced:
            succeed(replaced, copies)
            self.store.retire_replaced()
        yield Loaded(copies[0])

    def _publish(self, plan: TablePlan, copies: list[TableSet]) -> None:
        """Publish the operator's copies of `plan`'s set. A store's URL names one set at a
        time: a set loaded from it before (the bucket held another version) is no longer
        attached by id; the workers that hold it keep it."""
        self.store.publish(copies)
        if not plan.store:
            return
        for ts in self.store.sets.all():
            if ts.checkpoint == plan.store and ts.set_id != plan.set_id and ts.published:
                ts.published = False
                log.info(
                    "set %s is no longer what %s names (now set %s); its %d leases keep it",
                    ts.copy,
                    plan.store,
                    plan.set_id,
                    self.leases.count(ts),
                )

    async def _operator_plan(self, checkpoint: str, selection: str) -> TablePlan:
        """The plan of the operator's checkpoint: a folder (or file), kept while its files
        are unchanged (workers re-attaching after a restart name it), or an object store's
        prefix, planned from its objects."""
        if not is_store_url(checkpoint):
            return await self.readers.run(self.plans.plan, _operator_path(checkpoint), selection)
        remote = self._remote
        if remote is None or self._attestor is None:
            raise CheckpointError(
                f"{checkpoint} has no files on this node: its set is filled from the peers and "
                "that store and trusted by the fleet's attested manifest; start engramd with "
                "--peer-token-file (the fleet's token)"
            )
        plan = await self.readers.run(remote.planner.plan, checkpoint, selection)
        if not self.store.sets.copies(plan.set_id):
            # Its sizes are whatever the bucket's headers say: nothing is reserved (nor
            # evicted for it) before the fleet's key vouches for them.
            await self.readers.run(remote.planner.vouch, plan)
        return plan

    async def _prove_held(
        self, plan: TablePlan, ts: TableSet, verifying: Callable[[str], None] | None = None
    ) -> None:
        """Prove the operator's files hold the bytes of the set held under their id; for a
        checkpoint in an object store, which has no files here, the copy must carry the
        fleet's attestation of the set."""
        assert ts.manifest is not None
        if plan.store:
            unattested = self._unattested(ts) or (
                [] if ts.manifest.attestation else ["manifest.json: it carries no attestation"]
            )
            if unattested:
                raise CheckpointError(
                    f"set {ts.copy} held under the id of {plan.store}: {unattested[0]}, and this "
                    "node has no files to prove its bytes with; `engramd drop "
                    f"{ts.set_id}` and load it again (it is then filled from its sources)"
                )
            return
        proof = await self.readers.run(self.prover.judge, plan, ts.manifest)
        if not proof.unproven:
            return
        if verifying is not None:
            verifying(ts.set_id)
        held = await self.store.strong_digests(ts)
        progress = LoadProgress(proof.nbytes)
        await self.readers.run(self.prover.prove, proof, ts.manifest, held, progress)

    async def drop(self, set_id: str, force: bool) -> tuple[int, int]:
        """Unlink every copy of a set: (bytes, leases ended); as SetStore.drop."""
        return await self.store.drop(set_id, force)

    async def verify(self, set_id: str) -> Verified:
        """Recompute every copy's checksums; a copy with changed bytes fails verification:
        no new attach is served it, its leases' workers are told it is stale
        (SetStore.fail_verification), and the operator's next load of it loads it again.

        A filled set's checksums and kept strong digests must also still be the
        ones its origin attested (checked with the fleet's key, where this daemon
        has one); the strong digests are not taken again here.
        """
        checked = await self.store.verify(set_id)
        corrupted: list[str] = []
        told, fix = 0, ""
        for ts, tensors in checked:
            notes = self._unattested(ts)
            if not tensors and not notes:
                continue
            if self.store.sets.holds(ts):
                told += self.store.fail_verification(ts, tensors, notes)
                fix = reload_fix(ts)
            at = "" if ts.node is None else f" (node {ts.node})"
            corrupted += [name + at for name in tensors + notes]
        return Verified(checked[0][0], corrupted, told, fix)

    def _unattested(self, ts: TableSet) -> list[str]:
        """Why a filled copy's manifest is not the one its origin attested (none: it is, or
        this daemon has no fleet key to tell)."""
        key = self._attestor
        m = ts.manifest
        if key is None or m is None or m.attestation is None:
            return []
        if m.strong_digests is None:
            return [
                "manifest.json: an older engramd filled it and kept no strong digests, so "
                "its attestation cannot be checked"
            ]
        if not key.attested(m.attestation, m.set_id, m.fingerprint, m.tensors, m.strong_digests):
            return ["manifest.json: its digests are not the ones its origin attested"]
        return []

    # -- workers' attaches ----------------------------------------------------

    async def attach(self, intent: AttachIntent) -> AsyncGenerator[Progress | Granted, None]:
        """A worker's attach: progress of the load and of the proof of its files, then the
        set, how the worker maps it, and its lease (the caller ends it: `leases.end`)."""
        # Refused before any load when no backing could serve the worker.
        self._handle_kind(intent, self.store.backings)
        ts, plan = await self._resolve(intent)
        # Before any proof reads the worker's files (the lease book checks again).
        check_served(ts, intent)
        async for step in load_progress(ts):
            yield step
        if plan is not None:
            try:
                async with contextlib.aclosing(self._prove(ts, plan)) as steps:
                    async for step in steps:
                        yield step
            except FingerprintMismatch:
                twin = await self._twin(ts, plan, intent)
                if twin is None:
                    raise
                ts = twin
                async for step in load_progress(ts):
                    yield step
                async with contextlib.aclosing(self._prove(ts, plan)) as steps:
                    async for step in steps:
                        yield step
        await self._check_whole(ts, intent)
        kind = self._handle_kind(intent, [ts.backing], ts)
        route = self._gpu_route(intent, ts.backing, kind)
        # The files the plan read and the proof judged, held open: the fd
        # channel judges the peer against these, never a path again.
        readers = (
            () if plan is None else tuple(plan.held.get(f.path) or f.path for f in plan.sources)
        )
        # The files a lease was proven with are told only where every member of the
        # group may read them: the kernel names the caller only on the fd channel.
        reveal = ts.published or await self.readers.run(open_to_group, readers, self._group)
        lease = self.leases.add(ts, intent, kind, route, readers)
        yield Granted(ts, lease, kind, reveal)

    async def _check_whole(self, ts: TableSet, intent: AttachIntent) -> None:
        """Serve a copy whose files were cut short (root truncated one) no more."""
        if ts.manifest is None or intent.reattach:
            return
        damage = await self._checks.run(ts.backing.damage, ts.manifest)
        if damage and self.store.sets.holds(ts):
            log.error("set %s: %s", ts.copy, "; ".join(damage))
            self.store.fail_verification(ts, [], damage)
        check_served(ts, intent)

    @staticmethod
    def _handle_kind(
        intent: AttachIntent, backings: list[Backing], ts: TableSet | None = None
    ) -> HandleKind:
        """The first kind the worker accepts that one of `backings` has (for set `ts`).

        Paths are handed out for sets the operator published only: other sets'
        files are owner-only, and go out as descriptors over the fd channel,
        which checks the peer's uid may read the checkpoint.
        """
        accepted = intent.accept
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

    def _gpu_route(self, intent: AttachIntent, backing: Backing, kind: HandleKind) -> GpuRoute:
        """How the worker will read the set on its device, as the daemon allows it."""
        if not intent.device:
            return GpuRoute.UNSPECIFIED
        if kind in CUDA_KINDS:
            return GpuRoute.CUMEM_IMPORT
        if intent.gpu_route in (GpuRoute.REGISTER_READ_ONLY, GpuRoute.HOST_PAGE_TABLES):
            return intent.gpu_route
        if (
            intent.gpu_route is GpuRoute.REGISTER_WRITABLE
            and self._config.allow_writable_gpu_mappings
            and kind is HandleKind.FD
            and backing.writable_descriptors
        ):
            log.warning(
                "pid %d (as claimed; %s) gets writable descriptors of set %s: it says its GPU "
                "cannot register read-only memory (--allow-writable-gpu-mappings); "
                "`engramd verify %s` finds any write",
                intent.pid,
                intent.device,
                intent.set_id,
                intent.set_id,
            )
            return GpuRoute.REGISTER_WRITABLE
        return GpuRoute.UNSPECIFIED

    async def _resolve(self, intent: AttachIntent) -> tuple[TableSet, TablePlan | None]:
        """The set an attach maps, and the worker's plan of its checkpoint (if it named one).

        A bare set id attaches only a set the operator loaded: the worker
        socket cannot tell who asks (grpcio gives no peer credentials), so a
        set a worker's attach loaded is attached with its checkpoint, and proven.
        """
        sets = self.store.sets
        node = sets.copy_node_for(intent.numa_node)
        ts = sets.get(intent.set_id, node)
        held = sets.get(intent.set_id)
        if not intent.checkpoint and not sets.published(intent.set_id):
            # The same answer as for an id the daemon does not hold at all.
            held = ts = None
        plan = None
        if intent.checkpoint and held is not None and held.state is not SetState.FAILED:
            plan = await self._plan_for_held(intent, held)
        if ts is not None and ts.state is not SetState.FAILED:
            return ts, plan
        if held is not None and held.manifest is not None:
            # A copy on another node (--numa per-node).
            return await self.store.copy_for(held, node, self.readers), plan
        if intent.reattach or not intent.checkpoint:
            if ts is not None and ts.error is not None:
                raise ts.error
            raise UnknownSet(
                f"engramd holds no set {intent.set_id} it may attach by id; attach with the "
                "checkpoint folder, or have the operator load it (--checkpoint, engramd load)"
            )
        loaded = [s.checkpoint for s in sets.all() if s.state is not SetState.FAILED]
        path, beneath = self._policy.check_request(intent, loaded)
        plan = await self._planned(path, self._policy.selection(intent), beneath)
        self._policy.check_plan(path, plan, intent.set_id)
        charges = await self._checks.run(_charges, plan)
        return await self.store.ensure(plan, node, charges), plan

    async def _plan_for_held(self, intent: AttachIntent, held: TableSet) -> TablePlan:
        """The worker's plan of its checkpoint, for a set the daemon holds under its id.

        The daemon reads the worker's files as a load would: its own
        checkpoint's path, a configured one, or one under an allowed root.
        """
        path, beneath = self._policy.beneath(intent.checkpoint) or (
            resolve(intent.checkpoint),
            None,
        )
        if beneath is None and str(path) != held.checkpoint:
            path, beneath = self._policy.check_read(intent.checkpoint)
        plan = await self._planned(path, held.selection, beneath)
        if str(plan.checkpoint) != held.checkpoint:
            self._policy.check_plan(path, plan, intent.set_id)
        elif plan.set_id != intent.set_id:
            raise FingerprintMismatch(
                f"the daemon's view of {path} differs from the worker's: the files' names, "
                "sizes, headers or data differ; give the daemon and the worker the same checkpoint"
            )
        return plan

    async def _twin(self, ts: TableSet, plan: TablePlan, intent: AttachIntent) -> TableSet | None:
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
        if intent.reattach or not plan.held or any(s.path in loaded for s in plan.sources):
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
        return await self.store.ensure(own, ts.node, charges)

    async def _planned(self, path: Path, selection: str, beneath: Root | None) -> TablePlan:
        """The plan of a worker's checkpoint: kept (checked off the readers), or read now."""
        kept = await self._checks.run(self.plans.kept, path, selection, beneath)
        if kept is not None:
            return kept
        return await self.readers.run(self._plan, path, selection, beneath)

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

    async def _prove(self, ts: TableSet, plan: TablePlan) -> AsyncGenerator[Progress, None]:
        """Progress of proving the worker's files hold the set's bytes; raises when they do not."""
        assert ts.manifest is not None
        proof = await self._checks.run(self.prover.judge, plan, ts.manifest)
        if not proof.unproven:
            return
        held = await self.store.strong_digests(ts)
        progress = LoadProgress(proof.nbytes)
        if not proof.nbytes:
            # Every digest is kept: a comparison, no reads, no wait behind digests.
            await self._checks.run(self.prover.prove, proof, ts.manifest, held, progress)
            return
        task = asyncio.ensure_future(
            self._provers.run(self.prover.prove, proof, ts.manifest, held, progress)
        )
        # Its outcome is read below, or lost with a worker that hung up.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while not task.done():
                yield Progress(progress.done, progress.total)
                await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S)
        finally:
            # A worker that hangs up stops the digest at its next progress step.
            progress.cancel.set()
        task.result()

    # -- what callers may see -------------------------------------------------

    async def shown_to_group(self) -> Callable[[TableSet], bool]:
        """Which sets the worker socket shows in full: the operator's, and those whose files
        every member of the socket group may read.

        The modes are read on the checkpoint readers' threads: a checkpoint's
        folder may sit on a network mount that hangs, and the event loop
        serves every other call.
        """
        pending = {
            ts.key: [s.path for s in ts.manifest.sources] if ts.manifest else [ts.checkpoint]
            for ts in self.store.held()
            if not ts.published
        }
        readable = await self.readers.run(
            lambda: {key for key, files in pending.items() if open_to_group(files, self._group)}
        )
        return lambda ts: ts.published or ts.key in readable

    # -- upkeep and shutdown --------------------------------------------------

    async def sweep(self) -> None:
        """End leases whose process is gone; count new fallback records and remove stale ones;
        drop workers' sets idle past --worker-set-grace."""
        self.leases.sweep_dead()
        self.fallbacks.scan()
        await self.store.drop_abandoned(self._config.worker_set_grace)
        self.store.retire_replaced()

    async def close(self, drop: bool, grace: float) -> None:
        """Stop loads in progress, unlock every set, and unlink them if `drop` (SetStore.close)."""
        for task in self._planning:
            task.cancel()
        await self.store.close(drop=drop, grace=grace)


async def load_progress(ts: TableSet) -> AsyncGenerator[Progress, None]:
    """The set's load progress, four times a second, until the load ends; then the load's
    error, raised for every waiter, where it failed."""
    while not ts.done.is_set():
        yield Progress(ts.bytes_loaded, ts.nbytes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ts.done.wait(), PROGRESS_INTERVAL_S)
    if ts.state is SetState.FAILED and ts.error is not None:
        # One stored error, raised for each waiter: not chained to what any of them handles.
        raise ts.error from None


def kind_names(kinds: frozenset[HandleKind] | set[HandleKind]) -> str:
    """Kinds as the wire names them, in the wire's order: "HANDLE_KIND_SHM, HANDLE_KIND_FD"."""
    return ", ".join(f"HANDLE_KIND_{kind.name}" for kind in HandleKind if kind in kinds)


def _operator_path(checkpoint: str) -> Path:
    """The operator's checkpoint, resolved; CheckpointError where it cannot be (as plan_tables)."""
    try:
        return Path(checkpoint).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL byte
        raise CheckpointError(f"{checkpoint!r}: not a usable checkpoint path ({e})") from None


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
