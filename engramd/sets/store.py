"""The sets the daemon holds: adopted at start, loaded on demand, leased to workers.

Runs on the daemon's event loop; copying, checksumming, pinning and
unlinking run on daemon threads (blocking.py), so a drop of 189 GiB never
stalls health, status or attaches. A set is served only once its folder is
published and complete (state "ready"); a set that failed keeps its error
for status and is replaced by the next load of the same checkpoint.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engramd.backings import Backing
from engramd.errors import (
    BudgetExceeded,
    Draining,
    DropRefused,
    LoadFailed,
    ServiceError,
    ShmFull,
    TooManyLeases,
    UnknownSet,
)
from engramd.host.blocking import BlockingPool
from engramd.host.numa import Placement, bytes_per_node
from engramd.host.pagesize import PageCensus
from engramd.host.pinning import FIX_MEMLOCK, PinnedFiles
from engramd.sets.loader import DEFAULT_PLACEMENT, LoadCancelled, LoadProgress, load_set
from engramd.units import gib
from engramd_client.core.checkpoint import CheckpointError, TablePlan
from engramd_client.core.layout import Manifest, ManifestError, copy_name
from engramd_client.core.pb import engramd_pb2 as pb
from engramd_client.core.process import pid_namespace, start_ticks

log = logging.getLogger("engramd")


class SetState(enum.StrEnum):
    """Where a set is in its life; status and metrics show the value."""

    #: Being copied in; never handed out.
    LOADING = "loading"
    #: Complete and published: served to workers.
    READY = "ready"
    #: The load failed; the error is kept for status until the next load.
    FAILED = "failed"


class Stats:
    """Counters the event loop updates and the metrics thread reads, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attaches: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()

    def attach(self, ok: bool) -> None:
        """Count an attach answered with the set ("ok") or an error."""
        with self._lock:
            self._attaches["ok" if ok else "error"] += 1

    def fallback(self, cause: str) -> None:
        """Count a worker's fallback to private tables (a known cause)."""
        with self._lock:
            self._fallbacks[cause] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """(attaches by result, fallbacks by cause), copied."""
        with self._lock:
            return {"ok": 0, "error": 0, **self._attaches}, dict(self._fallbacks)


@dataclass
class Lease:
    """One worker attached to one set, for as long as its Attach stream is open."""

    lease_id: str
    set_id: str
    #: The name of the backing of the set the lease holds.
    backing: str
    #: The NUMA node of the copy the lease holds (--numa per-node), else None.
    node: int | None
    pid: int
    labels: dict[str, str]
    #: When the process `pid` started (clock ticks after boot), where the worker's
    #: claim (its pid namespace and start time) matched a process here, or the fd
    #: channel saw it; None: the sweep never judges this lease by its pid (the
    #: stream still ends it). A matching claim ends, at worst, the claimer's lease.
    pid_start: int | None
    #: The worker maps an earlier copy of the set than the one the daemon holds.
    stale: bool = False
    #: How the worker maps the set (engramd.v1.HandleKind).
    kind: int = pb.HANDLE_KIND_SHM
    #: The CUDA device the worker registers the set for ("cuda:N"), or "".
    device: str = ""
    #: How the worker reads the set on that device (engramd.v1.GpuRoute).
    gpu_route: int = pb.GPU_ROUTE_UNSPECIFIED
    #: One-time secret for the fd channel; "" once used.
    fd_secret: str = field(default_factory=lambda: secrets.token_hex(16))
    #: The worker's uid, once the kernel told it (SO_PEERCRED on the fd channel); None:
    #: unknown (the gRPC socket has no peer credentials).
    uid: int | None = None
    #: `pid` is the fd channel's peer as the kernel gave it, not the request's claim.
    pid_verified: bool = False
    #: A first attach for descriptors: it collects them within COLLECT_DEADLINE_S or
    #: ends, and is charged to its uid then. Any other lease is charged to "uid
    #: unknown" until its worker comes to the fd channel.
    collects: bool = False
    started: float = field(default_factory=time.monotonic)
    #: Set when the daemon ends the lease (sweep, drop or shutdown).
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: The lease was ended because the daemon is stopping.
    draining: bool = False


@dataclass
class TableSet:
    """One set: its state, its files once ready, its leases."""

    set_id: str
    checkpoint: str
    #: The fnmatch selection of tensors the set holds.
    selection: str
    fingerprint: str
    nbytes: int
    ntensors: int
    backing: Backing
    #: The NUMA node this copy is kept for (--numa per-node); None: the set's one copy.
    node: int | None = None
    state: SetState = SetState.LOADING
    adopted: bool = False
    #: The operator loaded it (--checkpoint, engramd load): any caller may see and
    #: attach it by its id. Sets that workers' attaches loaded are attached with
    #: their checkpoint only, and proven for it.
    published: bool = False
    manifest: Manifest | None = None
    progress: LoadProgress | None = None
    error: BaseException | None = None
    load_seconds: float = 0.0
    pins: PinnedFiles = field(default_factory=PinnedFiles)
    #: Every page of the set is locked in memory.
    locked: bool = False
    #: Bytes of the set on each NUMA node, as the daemon's pinned mappings show (numa_maps).
    nodes: dict[int, int] = field(default_factory=dict)
    #: The pages backing the set, as the kernel maps them (measured once ready), or None.
    pages: PageCensus | None = None
    leases: dict[str, Lease] = field(default_factory=dict)
    #: When a worker last attached or detached (or the set became ready).
    last_used: float = field(default_factory=time.monotonic)
    #: Not evicted as idle before this time (adopted sets: their workers re-attach).
    idle_after: float = 0.0
    #: Set once the load ends, ready or failed.
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def copy(self) -> str:
        """This copy's name in its backing: the set id, with the node of a per-node copy."""
        return copy_name(self.set_id, self.node)

    @property
    def key(self) -> SetKey:
        """How the store knows this copy."""
        return SetStore.key(self.set_id, self.backing, self.node)

    @property
    def bytes_loaded(self) -> int:
        """Bytes copied so far (all of them once ready)."""
        if self.state is SetState.READY:
            return self.nbytes
        return self.progress.done if self.progress else 0


#: A set is known by its id, its backing's name and the NUMA node of a per-node copy:
#: the id never depends on where the bytes are.
SetKey = tuple[str, str, int | None]

#: Seconds a first lease of descriptors (HANDLE_KIND_FD, not a re-attach) has to
#: collect them on the fd channel, where its uid becomes known; until then it is
#: charged to no uid.
COLLECT_DEADLINE_S = 10.0
#: Handle kinds whose workers collect descriptors on the fd channel.
ON_FD_CHANNEL = frozenset({pb.HANDLE_KIND_FD, pb.HANDLE_KIND_CUMEM})

#: Leases listed per set in a status reply (all are counted): a reply stays far
#: below gRPC's 4 MiB limit whatever the workers send.
STATUS_LEASES = 64

_PID_NAMESPACE = pid_namespace()


class SetStore:
    """Holds the daemon's sets and their leases."""

    def __init__(
        self,
        backings: list[Backing],
        load_threads: int,
        mlock: bool,
        memory_budget: int = 0,
        evict_idle: bool = False,
        adopt_grace_s: float = 0.0,
        max_leases: int = 0,
        placement: Placement = DEFAULT_PLACEMENT,
        leases_per_uid: int = 0,
    ) -> None:
        #: Where the sets' bytes may live, in order of preference.
        self.backings = backings
        self._load_threads = load_threads
        self._mlock = mlock
        self._budget = memory_budget
        self._evict_idle = evict_idle
        self._adopt_grace_s = adopt_grace_s
        self._max_leases = max_leases
        self._leases_per_uid = leases_per_uid
        self._placement = placement
        # Loads, and the daemon's own file work (pin, verify, unlink), each on
        # bounded daemon threads that never hold up shutdown.
        self._loads = BlockingPool("load", 4)
        self._files = BlockingPool("files", 4)
        #: The sets by (set id, backing, node): one checkpoint's copies in two backings, or
        #: on two nodes, are two sets.
        self.sets: dict[SetKey, TableSet] = {}
        #: Attaches served and refused, fallbacks reported (metrics).
        self.stats = Stats()
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_mlock = False

    # -- sets -----------------------------------------------------------------

    async def adopt_existing(
        self, verify: bool, verifying: Callable[[str], None] | None = None
    ) -> None:
        """Claim the backing; take over complete sets of the daemon's own left by an earlier one.

        The backing removes partial loads and anything not its own. With
        `verify`, every adopted set's checksums are recomputed first
        (`verifying(set_id)` is called before each) and a corrupted set is
        removed (a configured one is then loaded again).
        """
        for backing in self.backings:
            backing.claim()
            for manifest in await self._files.run(backing.adopt):
                await self._adopt(backing, manifest, verify, verifying)

    async def _adopt(
        self,
        backing: Backing,
        manifest: Manifest,
        verify: bool,
        verifying: Callable[[str], None] | None,
    ) -> None:
        if manifest.node not in self._placement.copy_nodes:
            kept = "one copy" if manifest.node is None else f"a copy for NUMA node {manifest.node}"
            log.info(
                "removing set %s: it was kept as %s, --numa %s keeps copies for %s",
                manifest.copy,
                kept,
                self._placement.policy or "(unset)",
                self._placement.copy_nodes,
            )
            await self._files.run(backing.remove, manifest.copy)
            return
        if verify:
            if verifying is not None:
                verifying(manifest.set_id)
            corrupted = await self._files.run(_corrupted, backing, manifest)
            if corrupted:
                log.error(
                    "removing set %s: tensors %s no longer match their checksums",
                    manifest.set_id,
                    ", ".join(corrupted),
                )
                await self._files.run(backing.remove, manifest.copy)
                return
        ts = TableSet(
            set_id=manifest.set_id,
            checkpoint=manifest.checkpoint,
            selection=manifest.selection,
            fingerprint=manifest.fingerprint,
            nbytes=manifest.nbytes,
            ntensors=len(manifest.tensors),
            backing=backing,
            node=manifest.node,
            state=SetState.READY,
            adopted=True,
            manifest=manifest,
            idle_after=time.monotonic() + self._adopt_grace_s,
        )
        ts.done.set()
        self.sets[ts.key] = ts
        self._spawn(self._pin(ts))
        log.info(
            "adopted set %s (%s, %s, %s) without reloading",
            ts.copy,
            ts.checkpoint,
            gib(ts.nbytes),
            backing.name,
        )

    @staticmethod
    def key(set_id: str, backing: Backing, node: int | None = None) -> SetKey:
        """How the store knows the copy of the set with this id in `backing` (for `node`)."""
        return set_id, backing.name, node

    def copies(self, set_id: str) -> list[TableSet]:
        """Every copy of the set with this id, in any state: by backing order, then node."""
        return [
            ts
            for b in self.backings
            for node in self._placement.copy_nodes
            if (ts := self.sets.get(self.key(set_id, b, node)))
        ]

    def get(self, set_id: str, node: int | None = None) -> TableSet | None:
        """The set with this id (its copy for `node`, if given): first not failed, by backing."""
        held = [ts for ts in self.copies(set_id) if node is None or ts.node == node]
        return next((ts for ts in held if ts.state is not SetState.FAILED), None) or next(
            iter(held), None
        )

    def published(self, set_id: str) -> bool:
        """True when the operator loaded the set with this id (any copy of it)."""
        return any(ts.published for ts in self.copies(set_id))

    def holds(self, ts: TableSet) -> bool:
        """True while `ts` itself is in the store (not dropped, not replaced by a reload)."""
        return self.sets.get(ts.key) is ts

    def copy_node_for(self, worker_node: int | None) -> int | None:
        """The node of the copy a worker on `worker_node` maps (None: the one copy)."""
        return self._placement.copy_node_for(worker_node)

    def find_lease(self, lease_id: str) -> tuple[TableSet, Lease] | None:
        """The set and the live lease with this id, if any."""
        for ts in self.sets.values():
            lease = ts.leases.get(lease_id)
            if lease is not None:
                return ts, lease
        return None

    async def ensure_everywhere(self, plan: TablePlan) -> list[TableSet]:
        """Every copy of the set of `plan` (one per node with --numa per-node), as `ensure`."""
        return [await self.ensure(plan, node) for node in self._placement.copy_nodes]

    async def ensure(self, plan: TablePlan, node: int | None = None) -> TableSet:
        """The set of `plan` (its copy for `node`), starting its load unless it is loading or ready.

        Nothing is evicted unless the load can then go ahead: the budget and
        the shm folder's capacity are judged first, counting what eviction frees.
        """
        ts = self.get(plan.set_id, node)
        if ts is not None and ts.state is not SetState.FAILED:
            return ts
        sizes = [t.nbytes for t in plan.tensors]
        needed = max(b.footprint(sizes) for b in self.backings)
        what = f"set {copy_name(plan.set_id, node)} ({plan.checkpoint})"
        while True:
            victims = self._victims(needed, what)
            backing = self._place(sizes, what, victims, node)
            if not victims:
                break
            for victim in victims:
                log.info(
                    "evicting idle set %s (%s) to make room for %s",
                    victim.set_id,
                    gib(victim.nbytes),
                    what,
                )
                if self.holds(victim) and not victim.leases:
                    await self._drop([victim])
            # Other loads may have started while the drops ran: judge again.
            ts = self.get(plan.set_id, node)
            if ts is not None and ts.state is not SetState.FAILED:
                return ts
        ts = TableSet(
            set_id=plan.set_id,
            checkpoint=str(plan.checkpoint),
            selection=plan.selection,
            fingerprint=plan.fingerprint,
            nbytes=plan.nbytes,
            ntensors=len(plan.tensors),
            backing=backing,
            node=node,
            progress=LoadProgress(plan.nbytes),
            # A copy for another node of a set the operator loaded is the operator's too.
            published=self.published(plan.set_id),
        )
        self.sets[ts.key] = ts
        self._spawn(self._load(ts, plan))
        return ts

    def _place(
        self, sizes: list[int], what: str, victims: list[TableSet], node: int | None
    ) -> Backing:
        """The first backing that can hold the tensors (counting what evicting `victims` frees)."""
        refusals = []
        for backing in self.backings:
            needed = backing.footprint(sizes)
            freed = sum(self._reserved(v) for v in victims if v.backing is backing)
            try:
                backing.check_capacity(needed, what, reclaimable=freed, node=node)
                return backing
            except ShmFull as e:
                refusals.append(e)
        if len(refusals) == 1:
            raise refusals[0]
        raise ShmFull(
            "; ".join(f"{b.name}: {e}" for b, e in zip(self.backings, refusals, strict=True))
        )

    def _victims(self, needed: int, what: str) -> list[TableSet]:
        """The idle sets to evict so that `needed` more bytes fit the budget; raises if none do."""
        if not self._budget:
            return []
        held = sum(
            self._reserved(ts) for ts in self.sets.values() if ts.state is not SetState.FAILED
        )
        victims: list[TableSet] = []
        if held + needed > self._budget and self._evict_idle:
            now = time.monotonic()
            idle = sorted(
                (
                    ts
                    for ts in self.sets.values()
                    if ts.state is SetState.READY and not ts.leases and ts.idle_after <= now
                ),
                key=lambda ts: ts.last_used,
            )
            for ts in idle:
                if held + needed <= self._budget:
                    break
                victims.append(ts)
                held -= self._reserved(ts)
        if held + needed > self._budget:
            raise BudgetExceeded(
                f"{what} needs {gib(needed)}, the daemon holds {gib(held)} of its "
                f"{gib(self._budget)} memory budget; drop a set (engramd drop), raise "
                "--memory-budget, or let idle sets be evicted (--evict-idle; sets adopted "
                "at start count as idle only after --adopt-grace)"
            )
        return victims

    def _reserved(self, ts: TableSet) -> int:
        if ts.manifest is None:
            return ts.backing.reserved(ts.nbytes)
        return ts.backing.footprint([t.nbytes for t in ts.manifest.tensors])

    async def drop(self, set_id: str, force: bool) -> tuple[int, int]:
        """Unlink every copy of a set; returns (bytes, leases ended).

        Refuses (dropping nothing) while a copy loads, or is leased unless
        `force`. The copies leave the store at once; unlocking and unlinking
        their files run on a thread (about a minute at 189 GiB).
        """
        copies = self.copies(set_id)
        if not copies:
            raise UnknownSet(f"engramd holds no set {set_id}")
        if any(ts.state is SetState.LOADING for ts in copies):
            raise DropRefused(f"set {set_id} is still loading; drop it once it is ready")
        leases = [lease for ts in copies for lease in ts.leases.values()]
        if leases and not force:
            raise DropRefused(
                f"set {set_id} has {len(leases)} leases (pids "
                f"{', '.join(str(lease.pid) for lease in leases)}); "
                "stop those workers or drop with --force (they keep their mappings)"
            )
        return await self._drop(copies)

    async def _drop(self, copies: list[TableSet]) -> tuple[int, int]:
        ended = [len(ts.leases) for ts in copies]
        for ts in copies:
            for lease in ts.leases.values():
                lease.ended.set()
            ts.leases.clear()
            del self.sets[ts.key]
        for ts, leases in zip(copies, ended, strict=True):
            await self._files.run(_remove, ts.backing, ts.pins, ts.copy)
            log.info("dropped set %s (%s, %d leases ended)", ts.copy, gib(ts.nbytes), leases)
        return sum(ts.nbytes for ts in copies), sum(ended)

    async def verify(self, set_id: str) -> tuple[TableSet, list[str]]:
        """The set, and the names of its tensors whose bytes no longer match the manifest.

        Every ready copy is checked; a tensor of a per-node copy is named with its node.
        """
        ready = [ts for ts in self.copies(set_id) if ts.manifest is not None]
        if not ready:
            raise UnknownSet(f"engramd holds no ready set {set_id}")
        corrupted = []
        for ts in ready:
            assert ts.manifest is not None
            try:
                names = await self._files.run(_corrupted, ts.backing, ts.manifest)
            except (OSError, ManifestError):
                if self.holds(ts):
                    raise
                raise UnknownSet(f"set {set_id} was dropped while it was being verified") from None
            corrupted += [name if ts.node is None else f"{name} (node {ts.node})" for name in names]
        return ready[0], corrupted

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def _load(self, ts: TableSet, plan: TablePlan) -> None:
        assert ts.progress is not None
        log.info(
            "loading set %s: %d tensors, %s from %s",
            ts.copy,
            ts.ntensors,
            gib(ts.nbytes),
            plan.checkpoint,
        )
        try:
            ts.manifest = await self._loads.run(
                load_set,
                plan,
                ts.backing,
                self._load_threads,
                ts.progress,
                self._placement,
                ts.node,
            )
        except BaseException as e:
            ts.state = SetState.FAILED
            ts.error = _load_error(ts, e)
            ts.done.set()
            log.error("set %s failed to load: %s", ts.copy, ts.error)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        ts.load_seconds = time.monotonic() - ts.progress.started
        ts.state = SetState.READY
        ts.last_used = time.monotonic()
        ts.done.set()
        log.info(
            "set %s ready: %s in %.2f s (%.2f GB/s)",
            ts.copy,
            gib(ts.nbytes),
            ts.load_seconds,
            ts.nbytes / max(ts.load_seconds, 1e-9) / 1e9,
        )
        await self._pin(ts)

    async def _pin(self, ts: TableSet) -> None:
        # After the set is served: locking walks every page (~0.4 s per GiB
        # on 4 KiB pages), which must not delay readiness or adoption.
        if ts.manifest is None:
            return
        ts.pages = await self._files.run(_census, ts.backing, ts.manifest)
        if not self._mlock:
            return
        for index in range(len(ts.manifest.tensors)):
            if not self.holds(ts):
                return  # dropped meanwhile: PinnedFiles unmaps what it still pins
            await self._files.run(ts.backing.pin, ts.manifest, index, ts.pins)
        ts.locked = ts.pins.error is None and self.holds(ts)
        if ts.locked:
            # Reading numa_maps walks the page tables of every mapping: once, off the loop.
            mapped_as = ts.backing.mapped_as(ts.copy)
            if mapped_as is not None:
                ts.nodes = await self._files.run(_nodes_of, mapped_as)
        if ts.pins.error and not self._warned_mlock:
            self._warned_mlock = True
            log.warning(
                "cannot lock set %s in memory (%s); its pages may be swapped out; %s",
                ts.set_id,
                ts.pins.error,
                FIX_MEMLOCK,
            )

    # -- leases ---------------------------------------------------------------

    def add_lease(
        self,
        ts: TableSet,
        request: pb.AttachRequest,
        kind: int,
        gpu_route: int = pb.GPU_ROUTE_UNSPECIFIED,
    ) -> Lease:
        """Record a worker attached to a ready set, mapping it by handles of `kind`."""
        if not self.holds(ts):
            raise UnknownSet(f"set {ts.set_id} was dropped while the worker waited; attach again")
        held = self.lease_count()
        if self._max_leases and held >= self._max_leases:
            raise TooManyLeases(
                f"engramd holds {held} leases, its limit (--max-leases); stop idle workers "
                "or raise the limit"
            )
        # A first lease of descriptors is charged to its uid once it collects
        # them (COLLECT_DEADLINE_S); any other lease's uid is unknown until its
        # worker comes to the fd channel, and all of those together hold one
        # uid's share.
        collects = kind in ON_FD_CHANNEL and not request.reattach
        if not collects:
            self._check_share(None)
        start = start_ticks(request.pid) if request.pid > 0 else None
        claimed = request.pid_namespace == _PID_NAMESPACE and start == request.pid_start
        lease = Lease(
            lease_id=secrets.token_hex(6),
            set_id=ts.set_id,
            backing=ts.backing.name,
            node=ts.node,
            pid=request.pid,
            labels=dict(request.labels),
            pid_start=start if claimed else None,
            stale=bool(
                request.nonce and ts.manifest is not None and request.nonce != ts.manifest.nonce
            ),
            kind=kind,
            device=request.device,
            gpu_route=gpu_route,
            collects=collects,
        )
        ts.leases[lease.lease_id] = lease
        ts.last_used = time.monotonic()
        return lease

    def lease_count(self) -> int:
        """Leases held on every set."""
        return sum(len(ts.leases) for ts in self.sets.values())

    def own_lease(self, lease: Lease, uid: int) -> None:
        """Charge `lease` to `uid`, as the kernel named its holder; raises TooManyLeases."""
        if lease.uid == uid:
            return
        self._check_share(uid)
        lease.uid = uid

    def _check_share(self, uid: int | None) -> None:
        """Raise TooManyLeases when `uid` (None: leases of unknown uid) holds its share."""
        if not self._leases_per_uid:
            return
        held = sum(
            1
            for ts in self.sets.values()
            for lease in ts.leases.values()
            if lease.uid == uid and (uid is not None or not lease.collects)
        )
        if held < self._leases_per_uid:
            return
        who = (
            f"uid {uid}"
            if uid is not None
            else "workers whose uid engramd cannot know (path handles, no fd channel)"
        )
        raise TooManyLeases(
            f"{who} hold {held} leases, one user's share of engramd's leases "
            "(--leases-per-uid); stop idle workers or raise the share"
        )

    def end_lease(self, lease: Lease) -> None:
        """Forget a lease (its stream closed)."""
        ts = self.sets.get((lease.set_id, lease.backing, lease.node))
        if ts is not None and ts.leases.pop(lease.lease_id, None) is not None:
            ts.last_used = time.monotonic()

    def sweep_dead(self) -> int:
        """End leases whose process is gone, or that never collected their descriptors.

        A pid that matched no process here is never judged: it may name
        another process here than the worker's (another pid namespace).
        Returns how many ended.
        """
        ended = 0
        now = time.monotonic()
        for ts in self.sets.values():
            for lease in list(ts.leases.values()):
                if lease.pid_start is not None and start_ticks(lease.pid) != lease.pid_start:
                    log.info(
                        "ending lease %s of set %s: pid %d is gone",
                        lease.lease_id,
                        ts.set_id,
                        lease.pid,
                    )
                elif (
                    lease.collects and lease.fd_secret and now - lease.started > COLLECT_DEADLINE_S
                ):
                    log.info(
                        "ending lease %s of set %s: pid %d did not collect its descriptors "
                        "within %.0f s",
                        lease.lease_id,
                        ts.set_id,
                        lease.pid,
                        COLLECT_DEADLINE_S,
                    )
                else:
                    continue
                lease.ended.set()
                ts.leases.pop(lease.lease_id, None)
                ended += 1
        return ended

    def drain(self) -> None:
        """End every lease, telling each worker that the daemon is stopping."""
        for ts in self.sets.values():
            for lease in ts.leases.values():
                lease.draining = True
                lease.ended.set()

    # -- shutdown -------------------------------------------------------------

    async def close(self, drop: bool, grace: float) -> None:
        """Stop loads in progress, unlock every set, and unlink them if `drop`.

        Waits at most `grace` seconds for each step: a load stuck on a hung
        checkpoint mount does not keep the daemon from exiting.
        """
        for ts in self.sets.values():
            if ts.progress is not None:
                ts.progress.cancel.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=grace)
        ready = [ts for ts in self.sets.values() if ts.state is SetState.READY]
        release = asyncio.ensure_future(self._files.run(_release_all, ready, drop))
        await asyncio.wait([release], timeout=grace)
        if drop:
            for ts in ready:
                log.info("dropped set %s", ts.copy)


def _remove(backing: Backing, pins: PinnedFiles, copy: str) -> None:
    pins.release()
    backing.remove(copy)


def _release_all(sets: list[TableSet], drop: bool) -> None:
    for ts in sets:
        if drop:
            _remove(ts.backing, ts.pins, ts.copy)
        else:
            ts.pins.release()


def _census(backing: Backing, manifest: Manifest) -> PageCensus | None:
    try:
        return backing.page_census(manifest)
    except (OSError, ManifestError) as e:
        # Dropped meanwhile, or a mapping the kernel refused: status shows the backing's pages.
        log.info("cannot tell the pages backing set %s (%s)", manifest.copy, e)
        return None


def _nodes_of(mapped_as: str) -> dict[int, int]:
    try:
        text = Path("/proc/self/numa_maps").read_text()
    except OSError:
        return {}  # a kernel without NUMA support
    return bytes_per_node(text, mapped_as)


def _corrupted(backing: Backing, manifest: Manifest) -> list[str]:
    return [
        t.name
        for i, t in enumerate(manifest.tensors)
        if backing.checksum(manifest, i) != t.checksum
    ]


def _load_error(ts: TableSet, e: BaseException) -> BaseException:
    if isinstance(e, ServiceError | CheckpointError):
        return e
    if isinstance(e, LoadCancelled | asyncio.CancelledError):
        return Draining(f"engramd stopped while loading set {ts.set_id}; attach again")
    return LoadFailed(f"loading set {ts.set_id} from {ts.checkpoint} failed: {e}")
