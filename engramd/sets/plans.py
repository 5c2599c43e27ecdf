"""Plans of workers' checkpoints, kept while the kernel's identity of every file holds.

Each attach that names a checkpoint is planned by the daemon (headers,
samples of the data, the fingerprint): 64 workers attaching at once name
the same one, and a checkpoint of 163 shards is 163 headers to read, hash
and parse per attach. A kept plan is handed out again only when, stat'ed
now, the checkpoint's folder, its index and each of its files have the
identity (device, inode, size, mtime, ctime) they had before and after it
was planned, and each file named through a symlink still resolves to the
same path: a file rewritten in place, renamed over, added, removed or
re-pointed is planned again. These are the identities the proof trusts
(proof.py); as there, files on tmpfs, ramfs or hugetlbfs, which change
under a shared mapping without a new mtime, are planned at every attach.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engramd.sets.proof import stamps_writes
from engramd_client.core.checkpoint import INDEX_FILE, TablePlan, checkpoint_files, plan_tables
from engramd_client.core.errors import CheckpointError
from engramd_client.core.fileid import SourceFile

#: Plans kept (checkpoint and selection each); a plan is a few KiB per selected tensor.
PLANS_KEPT = 64


@dataclass(frozen=True)
class _Snapshot:
    """What a plan of a checkpoint depends on, stat'ed at one moment."""

    #: The checkpoint (folder or file).
    root: SourceFile
    #: Its index (None: none).
    index: SourceFile | None
    #: Each file it lists, and where the listed name resolved to when it is a symlink
    #: ("" when it is not).
    files: tuple[tuple[SourceFile, str], ...]

    @property
    def listed(self) -> tuple[str, ...]:
        """The files' names as the checkpoint lists them."""
        return tuple(f.path for f, _ in self.files)


@dataclass(frozen=True)
class _Kept:
    plan: TablePlan
    snapshot: _Snapshot


class PlanCache:
    """plan_tables() for the daemon, planned once per checkpoint while its files are unchanged."""

    def __init__(self, kept: int = PLANS_KEPT) -> None:
        self._kept = kept
        self._plans: OrderedDict[tuple[str, str], _Kept] = OrderedDict()
        self._lock = threading.Lock()
        #: One planning at a time per checkpoint: a storm's first attaches wait for it.
        self._planning: dict[tuple[str, str], threading.Lock] = {}

    def plan(self, checkpoint: Path, selection: str) -> TablePlan:
        """The plan of resolved `checkpoint` under `selection`; blocks (run it on a thread)."""
        key = (str(checkpoint), selection)
        hit = self._valid(key)
        if hit is not None:
            return hit
        with self._lock:
            planning = self._planning.setdefault(key, threading.Lock())
        with planning:
            hit = self._valid(key)
            if hit is not None:
                return hit
            try:
                return self._plan(key, checkpoint, selection)
            finally:
                with self._lock:
                    self._planning.pop(key, None)

    def _valid(self, key: tuple[str, str]) -> TablePlan | None:
        with self._lock:
            kept = self._plans.get(key)
        if kept is None:
            return None
        if _stat_all(Path(key[0]), kept.snapshot.listed) != kept.snapshot:
            with self._lock:
                if self._plans.get(key) is kept:
                    del self._plans[key]
            return None
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
        return kept.plan

    def _plan(self, key: tuple[str, str], checkpoint: Path, selection: str) -> TablePlan:
        before = _snapshot(checkpoint)
        plan = plan_tables(checkpoint, selection)
        if before is None or before != _snapshot(checkpoint):
            return plan  # changed while it was read: good for this attach only
        if not all(stamps_writes(name) for name in before.listed):
            return plan
        with self._lock:
            # Under the selection it resolved to as well (auto: its family's), which
            # is what workers' attaches name.
            for name in dict.fromkeys((key, (key[0], plan.selection))):
                self._plans[name] = _Kept(plan, before)
                self._plans.move_to_end(name)
            while len(self._plans) > self._kept:
                self._plans.popitem(last=False)
        return plan


def _snapshot(checkpoint: Path) -> _Snapshot | None:
    """The identities a plan of `checkpoint` depends on; None when a file cannot be stat'ed."""
    try:
        listed, _ = checkpoint_files(checkpoint)
    except CheckpointError:
        return None
    return _stat_all(checkpoint, tuple(str(p) for p in listed))


def _stat_all(checkpoint: Path, listed: tuple[str, ...]) -> _Snapshot | None:
    """The identities of `checkpoint`, its index and the `listed` files now; None when one is gone.

    An unchanged folder (and index) lists the same files: the list is not read again.
    """
    try:
        st = os.stat(checkpoint)
        index = None
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                index = SourceFile.of(checkpoint / INDEX_FILE, os.stat(checkpoint / INDEX_FILE))
        files = tuple(
            (
                SourceFile.of(name, os.stat(name)),
                os.path.realpath(name) if os.path.islink(name) else "",
            )
            for name in listed
        )
    except OSError:
        return None
    return _Snapshot(SourceFile.of(checkpoint, st), index, files)
