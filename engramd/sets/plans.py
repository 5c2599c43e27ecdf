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
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engramd.sets.proof import stamps_writes
from engramd_shared.beneath import Root
from engramd_shared.checkpoint import (
    INDEX_FILE,
    TablePlan,
    checkpoint_files,
    files_beneath,
    plan_tables,
)
from engramd_shared.errors import CheckpointError, ReadersBusy
from engramd_shared.fileid import SourceFile

#: Plans kept (checkpoint and selection each); a plan is a few KiB per selected tensor.
PLANS_KEPT = 64
#: The longest safetensors header read for a worker's checkpoint (the reference reader
#: takes 100 MB, the operator's loads too): a shard's header is a few hundred KiB.
WORKER_HEADER_BYTES = 16 << 20
#: A header this long or longer costs about 10x its size to read and parse.
LARGE_HEADER_BYTES = 1 << 20
#: Large headers of one owner's files read at once for workers' attaches: a member's
#: own files are his to make, so his checkpoints cannot take every reader.
LARGE_HEADERS_PER_UID = 2
#: The share of the daemon's time one owner's large headers may take. Decoding and
#: parsing 12 MB of JSON holds the interpreter's lock for 30-80 ms at a stretch (one
#: long string, C code that never lets go), and a member who touches his files before
#: each attach has them parsed again every time: at two at once, the event loop then
#: waited for the lock at every step of every other member's attach (p99 1.5 s). After
#: a large header took t seconds, its owner's next one waits t * (1 - share) / share.
LARGE_HEADER_SHARE = 0.1


#: A kept plan's key: the checkpoint as named, the selection, whether it was opened beneath a root.
_Key = tuple[str, str, bool]


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
        self._plans: OrderedDict[_Key, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        #: One planning at a time per checkpoint: a storm's first attaches wait for it.
        self._planning: dict[_Key, threading.Lock] = {}
        self._large = _LargeHeaders(LARGE_HEADERS_PER_UID)

    def plan(self, checkpoint: Path, selection: str, beneath: Root | None = None) -> TablePlan:
        """The plan of `checkpoint` under `selection`; blocks (run it on a thread).

        With `beneath`, its files are opened beneath that root (a worker's
        checkpoint: `checkpoint` as written); without, `checkpoint` is resolved
        and the operator's.
        """
        key = (str(checkpoint), selection, beneath is not None)
        hit = self._valid(key, beneath)
        if hit is not None:
            return hit
        with self._lock:
            planning = self._planning.setdefault(key, threading.Lock())
        with planning:
            hit = self._valid(key, beneath)
            if hit is not None:
                return hit
            try:
                return self._plan(key, checkpoint, selection, beneath)
            finally:
                with self._lock:
                    self._planning.pop(key, None)

    def kept(
        self, checkpoint: Path, selection: str, beneath: Root | None = None
    ) -> TablePlan | None:
        """The kept plan of `checkpoint`, if every file's identity still holds; None otherwise.

        Stats and walks only, no reads of the files: the daemon runs it on
        threads of its own, so a kept plan is handed out while every reader of
        checkpoints is busy (or stuck).
        """
        return self._valid((str(checkpoint), selection, beneath is not None), beneath)

    def _valid(self, key: _Key, beneath: Root | None) -> TablePlan | None:
        with self._lock:
            kept = self._plans.get(key)
        if kept is None:
            return None
        if _stat_all(Path(key[0]), kept.snapshot.listed, beneath) != kept.snapshot:
            with self._lock:
                if self._plans.get(key) is kept:
                    del self._plans[key]
            return None
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
        return kept.plan

    def _plan(self, key: _Key, checkpoint: Path, selection: str, beneath: Root | None) -> TablePlan:
        before = _snapshot(checkpoint, beneath)
        if beneath is None:
            plan = plan_tables(checkpoint, selection)
        else:
            plan = plan_tables(
                checkpoint, selection, beneath, WORKER_HEADER_BYTES, self._large.admit
            )
        if before is None or before != _snapshot(checkpoint, beneath):
            return plan  # changed while it was read: good for this attach only
        if beneath is not None:
            stamped = all(stamps_writes(held.magic) for held in plan.held.values())
        else:
            stamped = all(stamps_writes(name) for name in before.listed)
        if not stamped:
            return plan
        with self._lock:
            # Under the selection it resolved to as well (auto: its family's), which
            # is what workers' attaches name.
            for name in dict.fromkeys((key, (key[0], plan.selection, key[2]))):
                self._plans[name] = _Kept(plan, before)
                self._plans.move_to_end(name)
            while len(self._plans) > self._kept:
                self._plans.popitem(last=False)
        return plan


class _LargeHeaders:
    """Large headers being read for workers, counted by their files' owner, and the time
    each owner's took (LARGE_HEADER_SHARE)."""

    def __init__(self, per_uid: int) -> None:
        self._per_uid = per_uid
        self._reading: Counter[int] = Counter()
        #: Per uid: when its next large header may be read.
        self._next: dict[int, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def admit(self, st: os.stat_result, length: int) -> Iterator[None]:
        """Read a header of `length` bytes of the file `st` within its owner's share."""
        if length < LARGE_HEADER_BYTES:
            yield
            return
        uid = st.st_uid
        now = time.monotonic()
        with self._lock:
            self._next = {u: t for u, t in self._next.items() if t > now}
            wait = self._next.get(uid, now) - now
            if self._reading[uid] >= self._per_uid or wait > 0:
                raise ReadersBusy(
                    f"engramd is reading {self._reading[uid]} headers of {LARGE_HEADER_BYTES >> 20}"
                    f" MiB or more of files of uid {uid} for workers' attaches, or read as many "
                    f"as their share of its time allows (the next in {max(wait, 0):.1f} s); "
                    "attach again once those are read, or have the operator load the "
                    "checkpoint (engramd load)"
                )
            self._reading[uid] += 1
        try:
            yield
        finally:
            end = time.monotonic()
            with self._lock:
                self._reading[uid] -= 1
                if not self._reading[uid]:
                    del self._reading[uid]
                owed = (end - now) * (1 - LARGE_HEADER_SHARE) / LARGE_HEADER_SHARE
                self._next[uid] = max(self._next.get(uid, end), end) + owed


def _snapshot(checkpoint: Path, beneath: Root | None) -> _Snapshot | None:
    """The identities a plan of `checkpoint` depends on; None when a file cannot be stat'ed."""
    try:
        if beneath is None:
            listed, _ = checkpoint_files(checkpoint)
        else:
            listed = list(files_beneath(checkpoint, beneath).names)
    except CheckpointError:
        return None
    return _stat_all(checkpoint, tuple(str(p) for p in listed), beneath)


def _stat_all(checkpoint: Path, listed: tuple[str, ...], beneath: Root | None) -> _Snapshot | None:
    """The identities of `checkpoint`, its index and the `listed` files now; None when one is gone.

    An unchanged folder (and index) lists the same files: the list is not read again.
    With `beneath`, each is found by a walk beneath that root, as a plan opens them.
    """
    if beneath is not None:
        return _stat_beneath(checkpoint, listed, beneath)
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


def _stat_beneath(checkpoint: Path, listed: tuple[str, ...], beneath: Root) -> _Snapshot | None:
    try:
        top = beneath.open(checkpoint, readable=False)
        st = top.file.stat()
        index = None
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(CheckpointError):
                found = beneath.open(Path(INDEX_FILE), top, readable=False)
                index = SourceFile.of(checkpoint / INDEX_FILE, found.file.stat())
            opened = [beneath.open(Path(Path(n).name), top, readable=False) for n in listed]
        else:
            opened = [top]
        files = tuple(
            (SourceFile.of(name, o.file.stat()), str(o.path))
            for name, o in zip(listed, opened, strict=True)
        )
    except (OSError, CheckpointError):
        return None
    return _Snapshot(SourceFile.of(checkpoint, st), index, files)
