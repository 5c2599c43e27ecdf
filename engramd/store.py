"""The sets the daemon holds: adopted at start, loaded on demand, leased to workers.

Runs on the daemon's event loop; copying, checksumming and pinning run on
threads. A set is served only once its folder is published and complete
(state "ready"); a set that failed keeps its error for status and is
replaced by the next load of the same checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from engramd_client.checkpoint import CheckpointError, TablePlan
from engramd_client.layout import (
    LOADING_MARK,
    Manifest,
    ManifestError,
    check_complete,
    read_manifest,
    set_dir,
    sets_root,
)

from .errors import BudgetExceeded, Draining, LoadFailed, ServiceError, UnknownSet
from .loader import LoadCancelled, LoadProgress, checksum_file, load_set, own
from .pinning import FIX_MEMLOCK, PinnedFiles
from .shmfs import check_capacity, gib

log = logging.getLogger("engramd")

_PAGE = 4096


@dataclass
class Lease:
    """One worker attached to one set, for as long as its Attach stream is open."""

    lease_id: str
    set_id: str
    pid: int
    labels: dict[str, str]
    #: The pid was alive in the daemon's pid namespace at attach, so the sweep may judge it.
    local: bool
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
    fingerprint: str
    nbytes: int
    ntensors: int
    state: str = "loading"
    adopted: bool = False
    manifest: Manifest | None = None
    progress: LoadProgress | None = None
    error: BaseException | None = None
    load_seconds: float = 0.0
    pins: PinnedFiles = field(default_factory=PinnedFiles)
    #: Every page of the set is locked in memory.
    locked: bool = False
    leases: dict[str, Lease] = field(default_factory=dict)
    #: When a worker last attached or detached (or the set became ready).
    last_used: float = field(default_factory=time.monotonic)
    #: Set once the load ends, ready or failed.
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def bytes_loaded(self) -> int:
        """Bytes copied so far (all of them once ready)."""
        if self.state == "ready":
            return self.nbytes
        return self.progress.done if self.progress else 0


def _pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


class SetStore:
    """Holds the daemon's sets and their leases."""

    def __init__(
        self,
        shm_dir: str,
        load_threads: int,
        mlock: bool,
        gid: int | None = None,
        memory_budget: int = 0,
        evict_idle: bool = False,
    ) -> None:
        self.shm_dir = shm_dir
        self._load_threads = load_threads
        self._mlock = mlock
        self._gid = gid
        self._budget = memory_budget
        self._evict_idle = evict_idle
        self.sets: dict[str, TableSet] = {}
        #: Attaches served and refused since start (metrics).
        self.attaches = {"ok": 0, "error": 0}
        #: Fallbacks workers reported, by cause (metrics).
        self.fallbacks: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_mlock = False

    # -- sets -----------------------------------------------------------------

    async def adopt_existing(self, verify: bool) -> None:
        """Take over complete sets left by an earlier daemon; remove partial loads.

        With `verify`, every adopted set's checksums are recomputed first and a
        corrupted set is removed (a configured one is then loaded again).
        """
        root = sets_root(self.shm_dir)
        root.mkdir(mode=0o750, parents=True, exist_ok=True)
        own(root, self._gid)
        for folder in sorted(root.iterdir()):
            if LOADING_MARK in folder.name:
                log.info("removing partial load %s", folder)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            try:
                manifest = read_manifest(folder)
                check_complete(folder, manifest)
            except (OSError, ManifestError) as e:
                log.warning("removing %s: not a complete set (%s)", folder, e)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            if verify:
                corrupted = await asyncio.to_thread(_corrupted, folder, manifest)
                if corrupted:
                    log.error(
                        "removing set %s: tensors %s no longer match their checksums",
                        manifest.set_id,
                        ", ".join(corrupted),
                    )
                    shutil.rmtree(folder, ignore_errors=True)
                    continue
            ts = TableSet(
                set_id=manifest.set_id,
                checkpoint=manifest.checkpoint,
                fingerprint=manifest.fingerprint,
                nbytes=manifest.nbytes,
                ntensors=len(manifest.tensors),
                state="ready",
                adopted=True,
                manifest=manifest,
            )
            ts.done.set()
            self.sets[ts.set_id] = ts
            self._spawn(self._pin(ts))
            log.info(
                "adopted set %s (%s, %s) without reloading",
                ts.set_id,
                ts.checkpoint,
                gib(ts.nbytes),
            )

    def get(self, set_id: str) -> TableSet | None:
        """The set with this id, in any state."""
        return self.sets.get(set_id)

    def ensure(self, plan: TablePlan) -> TableSet:
        """The set of `plan`, starting its load unless it is loading or ready."""
        ts = self.sets.get(plan.set_id)
        if ts is not None and ts.state != "failed":
            return ts
        needed = sum(_pages(t.nbytes) for t in plan.tensors)
        what = f"set {plan.set_id} ({plan.checkpoint})"
        self._within_budget(needed, what)
        check_capacity(self.shm_dir, needed, what)
        ts = TableSet(
            set_id=plan.set_id,
            checkpoint=str(plan.checkpoint),
            fingerprint=plan.fingerprint,
            nbytes=plan.nbytes,
            ntensors=len(plan.tensors),
            progress=LoadProgress(plan.nbytes),
        )
        self.sets[plan.set_id] = ts
        self._spawn(self._load(ts, plan))
        return ts

    def _within_budget(self, needed: int, what: str) -> None:
        if not self._budget:
            return
        held = sum(_pages(ts.nbytes) for ts in self.sets.values() if ts.state != "failed")
        if held + needed > self._budget and self._evict_idle:
            idle = sorted(
                (ts for ts in self.sets.values() if ts.state == "ready" and not ts.leases),
                key=lambda ts: ts.last_used,
            )
            for ts in idle:
                if held + needed <= self._budget:
                    break
                log.info(
                    "evicting idle set %s (%s) to make room for %s", ts.set_id, gib(ts.nbytes), what
                )
                held -= _pages(ts.nbytes)
                self.drop(ts.set_id, force=False)
        if held + needed > self._budget:
            raise BudgetExceeded(
                f"{what} needs {gib(needed)}, the daemon holds {gib(held)} of its "
                f"{gib(self._budget)} memory budget; drop a set (engramd drop), raise "
                "--memory-budget, or let idle sets be evicted (--evict-idle)"
            )

    def drop(self, set_id: str, force: bool) -> tuple[int, int]:
        """Unlink a set; returns (bytes, leases ended). Refuses a leased set unless `force`."""
        ts = self.sets.get(set_id)
        if ts is None:
            raise UnknownSet(f"engramd holds no set {set_id}")
        if ts.state == "loading":
            raise LoadFailed(f"set {set_id} is still loading; drop it once it is ready")
        if ts.leases and not force:
            raise LoadFailed(
                f"set {set_id} has {len(ts.leases)} leases (pids "
                f"{', '.join(str(lease.pid) for lease in ts.leases.values())}); "
                "stop those workers or drop with --force (they keep their mappings)"
            )
        leases = len(ts.leases)
        for lease in ts.leases.values():
            lease.ended.set()
        ts.leases.clear()
        ts.pins.release()
        del self.sets[set_id]
        shutil.rmtree(set_dir(self.shm_dir, set_id), ignore_errors=True)
        log.info("dropped set %s (%s, %d leases ended)", set_id, gib(ts.nbytes), leases)
        return ts.nbytes, leases

    async def verify(self, set_id: str) -> list[str]:
        """Names of the set's tensors whose bytes no longer match the manifest."""
        ts = self.sets.get(set_id)
        if ts is None or ts.manifest is None:
            raise UnknownSet(f"engramd holds no ready set {set_id}")
        return await asyncio.to_thread(_corrupted, set_dir(self.shm_dir, set_id), ts.manifest)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, ts: TableSet, plan: TablePlan) -> None:
        assert ts.progress is not None
        log.info(
            "loading set %s: %d tensors, %s from %s",
            ts.set_id,
            ts.ntensors,
            gib(ts.nbytes),
            plan.checkpoint,
        )
        try:
            ts.manifest = await asyncio.to_thread(
                load_set, plan, self.shm_dir, self._load_threads, ts.progress, self._gid
            )
        except BaseException as e:
            ts.state = "failed"
            ts.error = _load_error(ts, e)
            ts.done.set()
            log.error("set %s failed to load: %s", ts.set_id, ts.error)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        ts.load_seconds = time.monotonic() - ts.progress.started
        ts.state = "ready"
        ts.last_used = time.monotonic()
        ts.done.set()
        log.info(
            "set %s ready: %s in %.2f s (%.2f GB/s)",
            ts.set_id,
            gib(ts.nbytes),
            ts.load_seconds,
            ts.nbytes / max(ts.load_seconds, 1e-9) / 1e9,
        )
        await self._pin(ts)

    async def _pin(self, ts: TableSet) -> None:
        # After the set is served: locking walks every page (~0.4 s per GiB
        # on 4 KiB pages), which must not delay readiness or adoption.
        if not self._mlock or ts.manifest is None:
            return
        folder = set_dir(self.shm_dir, ts.set_id)
        for t in ts.manifest.tensors:
            await asyncio.to_thread(ts.pins.pin, folder / t.file)
        ts.locked = ts.pins.error is None and ts.set_id in self.sets
        if ts.pins.error and not self._warned_mlock:
            self._warned_mlock = True
            log.warning(
                "cannot lock set %s in memory (%s); its pages may be swapped out; %s",
                ts.set_id,
                ts.pins.error,
                FIX_MEMLOCK,
            )

    # -- leases ---------------------------------------------------------------

    def add_lease(self, ts: TableSet, pid: int, labels: dict[str, str]) -> Lease:
        """Record a worker attached to a ready set."""
        lease = Lease(
            lease_id=secrets.token_hex(6),
            set_id=ts.set_id,
            pid=pid,
            labels=labels,
            local=pid > 0 and psutil.pid_exists(pid),
        )
        ts.leases[lease.lease_id] = lease
        ts.last_used = time.monotonic()
        return lease

    def end_lease(self, lease: Lease) -> None:
        """Forget a lease (its stream closed)."""
        ts = self.sets.get(lease.set_id)
        if ts is not None and ts.leases.pop(lease.lease_id, None) is not None:
            ts.last_used = time.monotonic()

    def sweep_dead(self) -> int:
        """End the leases of local workers whose process is gone; returns how many."""
        ended = 0
        for ts in self.sets.values():
            for lease in list(ts.leases.values()):
                if lease.local and not psutil.pid_exists(lease.pid):
                    log.info(
                        "ending lease %s of set %s: pid %d is gone",
                        lease.lease_id,
                        ts.set_id,
                        lease.pid,
                    )
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

    async def close(self, drop: bool) -> None:
        """Stop loads in progress, unlock every set, and unlink them if `drop`."""
        for ts in self.sets.values():
            if ts.progress is not None:
                ts.progress.cancel.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for ts in self.sets.values():
            ts.pins.release()
            if drop and ts.state == "ready":
                shutil.rmtree(set_dir(self.shm_dir, ts.set_id), ignore_errors=True)
                log.info("dropped set %s", ts.set_id)


def _corrupted(folder: Path, manifest: Manifest) -> list[str]:
    return [
        t.name for t in manifest.tensors if checksum_file(folder / t.file, t.nbytes) != t.checksum
    ]


def _load_error(ts: TableSet, e: BaseException) -> BaseException:
    if isinstance(e, ServiceError | CheckpointError):
        return e
    if isinstance(e, LoadCancelled | asyncio.CancelledError):
        return Draining(f"engramd stopped while loading set {ts.set_id}; attach again")
    return LoadFailed(f"loading set {ts.set_id} from {ts.checkpoint} failed: {e}")
