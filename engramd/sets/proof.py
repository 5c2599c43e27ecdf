"""Whether a worker's checkpoint files hold the bytes of the set it attaches.

A set id covers names, sizes, headers and samples of the data, not every
byte: two files that differ between the samples share it. So a set is
handed out for a worker's checkpoint only when

- its files are the very files the set was loaded from, unchanged (device,
  inode, size, mtime, ctime as the load saw them), on a filesystem that
  updates mtime on every write; or
- a full digest of the worker's tensors equals the set's checksums.

Digests are kept per file identity (the kernel's, as above) and tensor range,
so a copy is read once, not once per attach. On tmpfs, ramfs and hugetlbfs a
write through a shared mapping changes neither mtime nor ctime: there the
identity proves nothing, and the tensors are digested at every attach.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engramd.checksum import digest_fd
from engramd.errors import FingerprintDiffers
from engramd.host.libc import HUGETLBFS_MAGIC, RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type
from engramd.sets.loader import LoadProgress
from engramd_client.core.beneath import Opened
from engramd_client.core.checkpoint import TablePlan
from engramd_client.core.errors import CheckpointError
from engramd_client.core.fileid import SourceFile, open_regular
from engramd_client.core.headers import TensorEntry
from engramd_client.core.layout import Manifest

#: Filesystems whose files change in place without a new mtime or ctime
#: (a write through a shared mapping of a tmpfs file stamps nothing).
UNSTAMPED_FILESYSTEMS = frozenset({TMPFS_MAGIC, RAMFS_MAGIC, HUGETLBFS_MAGIC})

#: Digests kept (a tensor range of a file identity each, ~200 bytes apiece).
DIGESTS_KEPT = 65536

_DigestKey = tuple[int, int, int, int, int, int, int]


def stamps_writes(path: str) -> bool:
    """True when every write to the file at `path` gives it a new mtime or ctime."""
    return filesystem_type(path) not in UNSTAMPED_FILESYSTEMS


@dataclass(frozen=True)
class Proof:
    """What proving a worker's plan against a set takes."""

    plan: TablePlan
    #: Tensors not proven by identity: each is digested (or its digest recalled).
    unproven: tuple[TensorEntry, ...]
    #: The worker's files whose identity changes on every write: their digests are kept.
    stamped: frozenset[SourceFile]
    #: Bytes to read: the unproven tensors whose digests are not kept (0: nothing to read).
    nbytes: int


class Prover:
    """Compares a worker's checkpoint with a set's bytes; remembers the digests it took."""

    def __init__(self, kept: int = DIGESTS_KEPT) -> None:
        self._kept = kept
        self._digests: OrderedDict[_DigestKey, str] = OrderedDict()
        self._lock = threading.Lock()

    def judge(self, plan: TablePlan, manifest: Manifest) -> Proof:
        """Which of the plan's tensors the set's own, unchanged files already prove."""
        loaded = set(manifest.sources)
        stamped = frozenset(s for s in plan.sources if stamps_writes(_where(plan, s)))
        trusted = {s.path for s in plan.sources if s in loaded and s in stamped}
        unproven = tuple(t for t in plan.tensors if str(t.file) not in trusted)
        sources = {s.path: s for s in plan.sources}
        with self._lock:
            kept = {
                t.name
                for t in unproven
                if sources[str(t.file)] in stamped
                and _key(sources[str(t.file)], t.offset, t.nbytes) in self._digests
            }
        return Proof(
            plan=plan,
            unproven=unproven,
            stamped=stamped,
            nbytes=sum(t.nbytes for t in unproven if t.name not in kept),
        )

    def prove(self, proof: Proof, manifest: Manifest, progress: LoadProgress) -> None:
        """Return when the proof's tensors hold the set's bytes; FingerprintDiffers otherwise.

        Runs on a thread: it may read every selected byte of the worker's files.
        """
        checksums = {t.name: t.checksum for t in manifest.tensors}
        sources = {s.path: s for s in proof.plan.sources}
        loaded = {s.path for s in manifest.sources}
        for entry in proof.unproven:
            source = sources[str(entry.file)]
            key = _key(source, entry.offset, entry.nbytes)
            with self._lock:
                digest = self._digests.get(key)
            if digest is None:
                held = proof.plan.held.get(source.path)
                digest = _digest(source, entry.offset, entry.nbytes, held)
                if source in proof.stamped:
                    self._keep(key, digest)
                progress.add(entry.nbytes)
            if digest != checksums.get(entry.name) and source.path in loaded:
                raise FingerprintDiffers(
                    f"{source.path} changed on disk after engramd loaded it (tensor "
                    f"{entry.name!r} no longer holds the set's bytes): its copy holds the earlier "
                    f"bytes; `engramd load {proof.plan.checkpoint}` loads the new version"
                )
            if digest != checksums.get(entry.name):
                # No set id here: the caller learns only that its bytes differ.
                raise FingerprintDiffers(
                    f"{entry.file}: tensor {entry.name!r} does not hold the bytes of the set "
                    "engramd holds under this id (the files share headers and samples but "
                    "not every byte); engramd serves a set only for files proven to hold its "
                    "bytes: the operator may drop that set (engramd drop) and load this copy"
                )

    def _keep(self, key: _DigestKey, digest: str) -> None:
        with self._lock:
            self._digests[key] = digest
            self._digests.move_to_end(key)
            while len(self._digests) > self._kept:
                self._digests.popitem(last=False)


def _key(source: SourceFile, offset: int, nbytes: int) -> _DigestKey:
    return (
        source.dev,
        source.ino,
        source.size,
        source.mtime_ns,
        source.ctime_ns,
        offset,
        nbytes,
    )


def _where(plan: TablePlan, source: SourceFile) -> str:
    """A path to `source` as the plan read it: the file it holds open, if it does."""
    held = plan.held.get(source.path)
    return held.magic if held is not None else source.path


def _digest(source: SourceFile, offset: int, nbytes: int, held: Opened | None) -> str:
    # A file the plan holds (opened beneath a root) is digested, never its path again.
    fd = held.reopen() if held is not None else open_regular(Path(source.path))
    with open(fd, "rb", buffering=0) as f:
        if SourceFile.of(source.path, os.fstat(f.fileno())) != source:
            raise CheckpointError(
                f"{source.path} changed since its headers were read; attach again once the "
                "file is final"
            )
        os.posix_fadvise(f.fileno(), offset, nbytes, os.POSIX_FADV_SEQUENTIAL)
        digest = digest_fd(f.fileno(), offset, nbytes)
        if SourceFile.of(source.path, os.fstat(f.fileno())) != source:
            raise CheckpointError(
                f"{source.path} changed while engramd compared it with its set; attach again "
                "once the file is final"
            )
    return digest
