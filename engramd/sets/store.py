"""The sets' states: adopted at start, loaded, published, pinned, verified (and failed
verification), dropped.

The sets themselves are in the registry (registry.py), where a load may go is
admission's call (admission.py), and the workers' leases are the lease book's
(leases.py); this module drives a set through its states, and says when the
daemon is ready: every set the operator configured is loaded. Who asks for
what (plans, proofs, workers' attaches) is the keeper's (keeper.py).

Runs on the daemon's event loop; copying, checksumming, pinning and
unlinking run on daemon threads (blocking.py), so a drop of 189 GiB never
stalls health, status or attaches. A set is served only once its folder is
published and complete (state "ready"); a set that failed keeps its error
for status and is replaced by the next load of the same checkpoint. A copy
that failed verification (`engramd verify` found changed bytes) takes no new
lease, its workers are told it is stale, and the operator's next load of it
loads it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from shlex import quote
from typing import Any

from engramd.backings import Backing
from engramd.host.blocking import BlockingPool
from engramd.host.numa import bytes_per_node
from engramd.host.pagesize import PageCensus
from engramd.host.pinning import FIX_MEMLOCK, PinnedFiles
from engramd.sets.admission import Admission
from engramd.sets.leases import LeaseBook
from engramd.sets.loader import DEFAULT_PLACEMENT, Fill, LoadCancelled, LoadProgress, load_set
from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import COMPLETE, SetState, TableSet
from engramd.sets.warming import PageCacheWarmer
from engramd.strong import STRONG
from engramd.units import gib
from engramd.values import Placement
from engramd_shared.checkpoint import TablePlan, is_store_url, plan_tables
from engramd_shared.errors import (
    CheckpointError,
    Draining,
    DropRefused,
    FailedVerification,
    LoadFailed,
    ShareError,
    UnknownSet,
)
from engramd_shared.families import family_of_selection
from engramd_shared.layout import Manifest, ManifestError, copy_name, extents

log = logging.getLogger("engramd")


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
        worker_share_per_uid: float = 0.0,
        fill: Fill | None = None,
        warm_page_cache: bool = True,
        plan_elsewhere: Callable[[str, str], TablePlan] | None = None,
    ) -> None:
        #: Where the sets' bytes may live, in order of preference.
        self.backings = backings
        self._load_threads = load_threads
        self._mlock = mlock
        self._adopt_grace_s = adopt_grace_s
        self._placement = placement
        # Where a load's bytes may come from before the files (the fleet's, sets/seams.py),
        # and what plans a checkpoint named by URL again (a copy for another node).
        self._fill = fill
        self._plan_elsewhere = plan_elsewhere
        #: The sets by (set id, backing, node): one checkpoint's copies in two backings, or
        #: on two nodes, are two sets.
        self.sets = SetRegistry(backings, placement)
        self._admission = Admission(
            backings, self.sets, memory_budget, evict_idle, worker_share_per_uid
        )
        #: The workers' leases of the sets.
        self.leases = LeaseBook(self.sets, max_leases, leases_per_uid)
        # Loads, and the daemon's own file work (pin, verify, unlink), each on
        # bounded daemon threads that never hold up shutdown.
        self._loads = BlockingPool("load", 4)
        self._files = BlockingPool("files", 4)
        # Disk sets read into the page cache once each is served.
        self._warmer = PageCacheWarmer(warm_page_cache)
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_mlock = False
        #: Every copy of the sets the operator configured (--checkpoint), once loading.
        self.configured: list[TableSet] = []
        # A configured checkpoint gave no set: the daemon never becomes ready.
        self._incomplete = False
        # Configured checkpoints still being planned (an object store's), and an event set
        # whenever none is.
        self._planning = 0
        self._planned = asyncio.Event()
        self._planned.set()
        self._ready = False

    # -- readiness ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every configured set is loaded: health SERVING, systemd READY=1, status "ready".

        Set once, when the configured loads end (settle); it stays while the daemon runs.
        """
        return self._ready

    def configure(self, copies: list[TableSet] | None) -> None:
        """Count `copies` among the configured sets; None: a configured checkpoint that gave
        none (the daemon then never becomes ready)."""
        if copies is None:
            self._incomplete = True
        else:
            self.configured += copies

    def configure_later(self) -> None:
        """A configured checkpoint is being planned: `configure` comes later, then
        `configured_later`; the daemon is not ready before."""
        self._planning += 1
        self._planned.clear()

    def configured_later(self) -> None:
        """A planning that `configure_later` announced ended (and called `configure`)."""
        self._planning -= 1
        if not self._planning:
            self._planned.set()

    async def settle(self, interval: float, waiting: Callable[[], None]) -> bool:
        """Wait for every configured checkpoint's planning and load to end, calling
        `waiting()` every `interval` seconds until then; ready (True) when every configured
        set is."""
        while self._planning or not all(ts.done.is_set() for ts in self.configured):
            waiting()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(
                        self._planned.wait(), *(ts.done.wait() for ts in self.configured)
                    ),
                    interval,
                )
        self._ready = not self._incomplete and all(
            ts.state is SetState.READY for ts in self.configured
        )
        return self._ready

    def held(self) -> list[TableSet]:
        """Every copy the store holds, in any state, in the order they came."""
        return self.sets.all()

    def offered(self, set_id: str) -> TableSet | None:
        """A ready copy of a set the operator published (what other daemons may fill from)."""
        for ts in self.sets.copies(set_id):
            if ts.state is SetState.READY and ts.published and ts.manifest is not None:
                return ts
        return None

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
        self.sets.add(ts)
        self._spawn(self._pin(ts))
        log.info(
            "adopted set %s (%s, %s, %s) without reloading",
            ts.copy,
            ts.checkpoint,
            gib(ts.nbytes),
            backing.name,
        )

    async def ensure_everywhere(self, plan: TablePlan) -> list[TableSet]:
        """Every copy of the set of `plan` (one per node with --numa per-node), as `ensure`."""
        return [await self.ensure(plan, node) for node in self._placement.copy_nodes]

    async def ensure(
        self, plan: TablePlan, node: int | None = None, charges: dict[int, int] | None = None
    ) -> TableSet:
        """The set of `plan` (its copy for `node`), starting its load unless it is loading or ready.

        Nothing is evicted unless the load can then go ahead: the budget and
        the shm folder's capacity are judged first, counting what eviction frees.
        `charges`: a worker's load, its bytes by the uid owning their files
        (within --worker-share-per-uid; dropped after --worker-set-grace unleased).
        """
        ts = self.sets.get(plan.set_id, node)
        if ts is not None and ts.state is not SetState.FAILED:
            return ts
        sizes = extents(plan.tensors)
        needed = self._admission.needed(sizes)
        what = f"set {copy_name(plan.set_id, node)} ({plan.where})"
        if charges is not None:
            self._admission.check_share(charges, what)
        while True:
            victims = self._admission.victims(needed, what)
            backing = self._admission.place(sizes, what, victims, node)
            if not victims:
                break
            for victim in victims:
                log.info(
                    "evicting idle set %s (%s) to make room for %s",
                    victim.set_id,
                    gib(victim.nbytes),
                    what,
                )
                if self.sets.holds(victim) and not self.leases.count(victim):
                    await self._drop([victim])
            # Other loads may have started while the drops ran: judge again.
            ts = self.sets.get(plan.set_id, node)
            if ts is not None and ts.state is not SetState.FAILED:
                return ts
        ts = TableSet(
            set_id=plan.set_id,
            checkpoint=plan.where,
            selection=plan.selection,
            fingerprint=plan.fingerprint,
            nbytes=plan.nbytes,
            ntensors=len(plan.tensors),
            backing=backing,
            node=node,
            progress=LoadProgress(plan.nbytes, copy_name(plan.set_id, node)),
            # A copy for another node of a set the operator loaded is the operator's too;
            # never a worker's load from its own files under that id.
            published=charges is None and self.sets.published(plan.set_id),
            charges=None if charges is None else dict(charges),
        )
        self.sets.add(ts)
        self._spawn(self._load(ts, plan))
        return ts

    async def strong_digests(self, ts: TableSet) -> dict[str, str]:
        """Each tensor's strong digest of copy `ts`'s bytes, by name: those its fill landed
        and checked (a filled set's manifest keeps them), else taken from its pages (on a
        files thread; BLAKE3, about 0.35 CPU-s a GiB) and kept with the copy."""
        if ts.strong is None:
            assert ts.manifest is not None
            ts.strong = await self._files.run(_strong_of, ts.backing, ts.manifest)
        return ts.strong

    def publish(self, copies: list[TableSet]) -> None:
        """Publish sets the operator loaded: any caller may attach them by id, and map them
        by path (their files become readable by the socket group). The one place a set
        is published: the keeper's loads and a published set's copy for another node."""
        for ts in copies:
            if ts.manifest is not None:
                ts.backing.share_with_group(ts.manifest)
            ts.published = True

    async def copy_for(self, held: TableSet, node: int | None, readers: BlockingPool) -> TableSet:
        """The copy for `node` of a set held for another node (--numa per-node), as `ensure`.

        It comes from the checkpoint and selection the held copy was loaded
        from, read again on `readers` (a checkpoint may sit on a mount that hangs).
        """
        assert held.manifest is not None
        selection = held.manifest.selection
        if not is_store_url(held.checkpoint):
            source = await readers.run(plan_tables, held.checkpoint, selection)
        elif self._plan_elsewhere is not None:
            source = await readers.run(self._plan_elsewhere, held.checkpoint, selection)
        else:
            raise LoadFailed(
                f"set {held.set_id} came from {held.checkpoint}, which only the fleet can "
                f"plan, so no copy for NUMA node {node} can be made; start engramd with "
                "--peer-token-file (the fleet's token)"
            )
        if source.set_id != held.set_id:
            raise LoadFailed(
                f"{held.checkpoint} changed since set {held.set_id} was loaded from it, so no "
                f"copy for NUMA node {node} can be made; load the checkpoint again"
            )
        return await self.ensure(source, node)

    async def drop(self, set_id: str, force: bool) -> tuple[int, int]:
        """Unlink every copy of a set; returns (bytes, leases ended).

        Refuses (dropping nothing) while a copy loads, or is leased unless
        `force`. The copies leave the store at once; unlocking and unlinking
        their files run on a thread (about a minute at 189 GiB).
        """
        copies = self.sets.copies(set_id)
        if not copies:
            raise UnknownSet(f"engramd holds no set {set_id}")
        if any(ts.state is SetState.LOADING for ts in copies):
            raise DropRefused(f"set {set_id} is still loading; drop it once it is ready")
        leases = [lease for ts in copies for lease in self.leases.listed(ts)]
        if leases and not force:
            raise DropRefused(
                f"set {set_id} has {len(leases)} leases (pids "
                f"{', '.join(str(lease.pid) for lease in leases)}); "
                "stop those workers or drop with --force (they keep their mappings)"
            )
        return await self._drop(copies)

    async def _drop(self, copies: list[TableSet]) -> tuple[int, int]:
        ended = [self.leases.end_all(ts) for ts in copies]
        for ts in copies:
            self.sets.remove(ts)
            self._warmer.forget(ts)
        for ts, leases in zip(copies, ended, strict=True):
            await self._files.run(_remove, ts.backing, ts.pins, ts.copy)
            log.info("dropped set %s (%s, %d leases ended)", ts.copy, gib(ts.nbytes), leases)
        return sum(ts.nbytes for ts in copies), sum(ended)

    async def verify(self, set_id: str) -> list[tuple[TableSet, list[str]]]:
        """Every complete copy of a set, each with the names of its tensors whose bytes no
        longer match the manifest (fail_verification marks it)."""
        complete = [ts for ts in self.sets.copies(set_id) if ts.manifest is not None]
        if not complete:
            raise UnknownSet(f"engramd holds no ready set {set_id}")
        checked = []
        for ts in complete:
            assert ts.manifest is not None
            try:
                names = await self._files.run(_corrupted, ts.backing, ts.manifest)
            except (OSError, ManifestError):
                if self.sets.holds(ts):
                    raise
                raise UnknownSet(f"set {set_id} was dropped while it was being verified") from None
            checked.append((ts, names))
        return checked

    def fail_verification(self, ts: TableSet, tensors: list[str], notes: list[str]) -> int:
        """Serve copy `ts` no more: a verify found `tensors` changed (and `notes`, other
        findings); its leases' workers are told it is stale. Returns how many were told.

        It stays so until the operator loads the set again (replace_failed) or drops it.
        """
        what = list(notes)
        if tensors:
            what.insert(0, f"the bytes of {', '.join(tensors)} no longer match their checksums")
        ts.state = SetState.FAILED_VERIFICATION
        ts.changed = list(tensors)
        ts.error = FailedVerification(
            f"set {ts.copy} failed verification: {'; '.join(what)}; engramd hands out this "
            f"copy no more; {reload_fix(ts)}"
        )
        return self.leases.tell_stale(ts)

    async def replace_failed(self, set_id: str) -> None:
        """Drop the copies of a set that failed verification, so that a load makes them anew.

        Their leases end; their workers keep their mappings and re-attach to the new
        copy, which status and the workers mark stale.
        """
        failed = [ts for ts in self.sets.copies(set_id) if ts.state is SetState.FAILED_VERIFICATION]
        for ts in failed:
            log.info("loading set %s again: it failed verification", ts.copy)
        if failed:
            await self._drop(failed)

    def retire_replaced(self) -> None:
        """Drop each copy a later generation replaced once its last lease is gone: its
        memory goes back (engramd.sets.generations). A copy an older generation's leases
        are still to move to stays until they have (they move on from it at once)."""
        held = self.sets.all()
        retiring: dict[int, TableSet] = {}
        more = True
        while more:
            more = False
            awaited = {o.replaced_by for o in held if id(o) not in retiring}
            for ts in held:
                if (
                    id(ts) not in retiring
                    and ts.replaced_by
                    and not ts.leases
                    and ts.state is SetState.READY
                    and ts.set_id not in awaited
                ):
                    retiring[id(ts)] = ts
                    more = True
        for ts in retiring.values():
            self._spawn(self._retire(ts))

    async def _retire(self, ts: TableSet) -> None:
        # Once: a second call before this task ran finds it gone (_drop removes it first).
        if self.sets.holds(ts):
            log.info("set %s: its last lease moved to set %s; dropping it", ts.copy, ts.replaced_by)
            await self._drop([ts])

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
            plan.where,
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
                self._fill,
            )
        except BaseException as e:
            ts.state = SetState.FAILED
            ts.error = _load_error(ts, e)
            ts.done.set()
            log.error("set %s failed to load: %s", ts.copy, ts.error)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if ts.published:
            # A copy for another node of a set the operator published.
            self.publish([ts])
        ts.load_seconds = time.monotonic() - ts.progress.started
        self.leases.stats.received(ts.bytes_by_source or {_source_kind(ts.source): ts.nbytes})
        ts.state = SetState.READY
        ts.last_used = time.monotonic()
        ts.done.set()
        log.info(
            "set %s ready: %s from %s in %.2f s (%.2f GB/s)",
            ts.copy,
            gib(ts.nbytes),
            ts.source,
            ts.load_seconds,
            ts.nbytes / max(ts.load_seconds, 1e-9) / 1e9,
        )
        await self._pin(ts)

    async def _pin(self, ts: TableSet) -> None:
        # After the set is served: locking walks every page (~0.4 s per GiB
        # on 4 KiB pages), and a disk set's warm-up reads it, neither of which
        # may delay readiness or adoption.
        if ts.manifest is None:
            return
        ts.pages = await self._files.run(_census, ts.backing, ts.manifest)
        await self._warmer.warm(ts)
        if not self._mlock or not ts.backing.lockable:
            return
        for index in range(len(ts.manifest.tensors)):
            if not self.sets.holds(ts):
                return  # dropped meanwhile: PinnedFiles unmaps what it still pins
            await self._files.run(ts.backing.pin, ts.manifest, index, ts.pins)
        ts.locked = ts.pins.error is None and self.sets.holds(ts)
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

    async def drop_abandoned(self, grace_s: float) -> None:
        """Drop the sets workers' attaches loaded that no worker has held for `grace_s` seconds.

        The operator's sets (published) and sets adopted at start are kept.
        """
        if not grace_s:
            return
        now = time.monotonic()
        for ts in self.sets.all():
            if (
                ts.charges is not None
                and not ts.published
                and ts.state in COMPLETE
                and not self.leases.count(ts)
                and now - ts.last_used > grace_s
                and self.sets.holds(ts)
            ):
                log.info(
                    "dropping set %s (%s, %s): a worker's attach loaded it and no worker has "
                    "held it for %.0f s (--worker-set-grace)",
                    ts.copy,
                    ts.checkpoint,
                    gib(ts.nbytes),
                    grace_s,
                )
                await self._drop([ts])

    # -- shutdown -------------------------------------------------------------

    async def close(self, drop: bool, grace: float) -> None:
        """Stop loads in progress, unlock every set, and unlink them if `drop`.

        Waits at most `grace` seconds for each step: a load stuck on a hung
        checkpoint mount does not keep the daemon from exiting.
        """
        self._warmer.close()
        for ts in self.sets.all():
            if ts.progress is not None:
                ts.progress.cancel.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=grace)
        complete = [ts for ts in self.sets.all() if ts.state in COMPLETE]
        release = asyncio.ensure_future(self._files.run(_release_all, complete, drop))
        await asyncio.wait([release], timeout=grace)
        if drop:
            for ts in complete:
                log.info("dropped set %s", ts.copy)


def reload_fix(ts: TableSet) -> str:
    """How the operator gets set `ts` served again once a copy of it failed verification."""
    if not ts.published:
        # A worker's attach loaded it: the next one loads it again from its own files.
        return f"drop it (engramd drop {ts.set_id} --force): the next attach loads it again"
    # A selection of the operator's own is named: `load` takes each family's by default.
    selection = "" if family_of_selection(ts.selection) else f" --tensors {quote(ts.selection)}"
    return f"load it again: engramd load {quote(ts.checkpoint)}{selection}"


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


def _strong_of(backing: Backing, manifest: Manifest) -> dict[str, str]:
    kept = manifest.strong_digests
    if kept is not None and len(kept) == len(manifest.tensors):
        return {t.name: d for t, d in zip(manifest.tensors, kept, strict=True)}
    return {t.name: backing.checksum(manifest, i, STRONG) for i, t in enumerate(manifest.tensors)}


def _load_error(ts: TableSet, e: BaseException) -> BaseException:
    if isinstance(e, ShareError | CheckpointError):
        return e
    if isinstance(e, LoadCancelled | asyncio.CancelledError):
        return Draining(f"engramd stopped while loading set {ts.set_id}; attach again")
    return LoadFailed(f"loading set {ts.set_id} from {ts.checkpoint} failed: {e}")


def _source_kind(source: str) -> str:
    """A load's one source as the received-bytes counter labels it: "files", "s3://...", or
    the peer's HOST:PORT ("peer HOST:PORT" says it)."""
    return source.removeprefix("peer ")
