"""Whether a checkpoint's files hold the bytes of the set held under its id.

A set id covers names, sizes, headers and samples of the data, not every
byte: two files that differ between the samples share it. So a held set is
handed out for a worker's checkpoint, or published for the operator's
(`engramd load`, --checkpoint, a set adopted after a restart), only when

- its files are the very files the set was loaded from, unchanged (device,
  inode, size, mtime, ctime as the load saw them), on a filesystem that
  updates mtime on every write: the daemon read those bytes itself, and the
  manifest that says so is written by the daemon alone, in its own folder
  (no read at all: a restart's adoption stays instant); or
- the strong digest (engramd.strong: BLAKE3 over 16 MiB pieces) of the
  files' tensors equals the held set's, taken from the set's own pages once
  (or landed and kept by its fill). Never the manifest's XXH3 checksums:
  with XXH3's public secret a second preimage of a piece is arithmetic, so
  a copy built to share them would pass.

Digests of the files are kept per file identity (the kernel's, as above) and
tensor range, so a copy is read once, not once per attach. On tmpfs, ramfs
and hugetlbfs a write through a shared mapping changes neither mtime nor
ctime: there the identity proves nothing, and the tensors are digested at
every attach.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engramd.checksum import chunks
from engramd.host.libc import HUGETLBFS_MAGIC, RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type
from engramd.sets.loader import LoadProgress
from engramd.strong import STRONG, digester
from engramd_shared.beneath import Opened
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import CheckpointError, FingerprintMismatch
from engramd_shared.fileid import SourceFile, open_regular
from engramd_shared.headers import TensorEntry
from engramd_shared.layout import Manifest

#: Filesystems whose files change in place without a new mtime or ctime
#: (a write through a shared mapping of a tmpfs file stamps nothing).
UNSTAMPED_FILESYSTEMS = frozenset({TMPFS_MAGIC, RAMFS_MAGIC, HUGETLBFS_MAGIC})

#: Digests kept (a tensor range of a file identity each, ~200 bytes apiece).
DIGESTS_KEPT = 65536

_DigestKey = tuple[int, ...]


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
        unproven = tuple(
            t for t in plan.tensors if not all(str(p.file) in trusted for p in t.spans)
        )
        sources = {s.path: s for s in plan.sources}
        with self._lock:
            kept = {
                t.name
                for t in unproven
                if all(sources[str(p.file)] in stamped for p in t.spans)
                and _key(sources, t) in self._digests
            }
        return Proof(
            plan=plan,
            unproven=unproven,
            stamped=stamped,
            nbytes=sum(t.nbytes for t in unproven if t.name not in kept),
        )

    def prove(
        self, proof: Proof, manifest: Manifest, held: Mapping[str, str], progress: LoadProgress
    ) -> None:
        """Return when the proof's tensors hold the set's bytes; FingerprintMismatch otherwise.

        `held`: the held set's strong digests by tensor name (SetStore.strong_digests).
        Runs on a thread: it may read every selected byte of the files.
        """
        sources = {s.path: s for s in proof.plan.sources}
        loaded = {s.path for s in manifest.sources}
        for entry in proof.unproven:
            files = [sources[str(p.file)] for p in entry.spans]
            key = _key(sources, entry)
            # A tensor the held set has no strong digest of is proven by nothing.
            expected = held.get(entry.name, f"{STRONG}:")
            with self._lock:
                digest = self._digests.get(key)
            if digest is None:
                digest = _digest(sources, entry, proof.plan.held, expected)
                if all(f in proof.stamped for f in files):
                    self._keep(key, digest)
                progress.add(entry.nbytes)
            if digest == expected:
                continue
            changed = next((f.path for f in files if f.path in loaded), None)
            if changed is not None:
                raise FingerprintMismatch(
                    f"{changed} changed on disk after engramd loaded it (tensor "
                    f"{entry.name!r} no longer holds the set's bytes): its copy holds the earlier "
                    f"bytes; `engramd load {proof.plan.checkpoint}` loads the new version"
                )
            # No set id here: the caller learns only that its bytes differ.
            raise FingerprintMismatch(
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


def _key(sources: dict[str, SourceFile], entry: TensorEntry) -> _DigestKey:
    """A tensor's bytes by the identity of each file they lie in, and where."""
    key: list[int] = []
    for span in entry.spans:
        f = sources[str(span.file)]
        key += (f.dev, f.ino, f.size, f.mtime_ns, f.ctime_ns, span.offset, span.nbytes)
    return tuple(key)


def _where(plan: TablePlan, source: SourceFile) -> str:
    """A path to `source` as the plan read it: the file it holds open, if it does."""
    held = plan.held.get(source.path)
    return held.magic if held is not None else source.path


def _digest(
    sources: dict[str, SourceFile], entry: TensorEntry, held: Mapping[str, Opened], like: str
) -> str:
    """The strong digest, of the kind `like` names, of a tensor's bytes ("short" where a file
    ends first).

    A file the plan holds (opened beneath a root) is digested, never its path again.
    """
    digest = digester(like)
    for span in entry.spans:
        source = sources[str(span.file)]
        opened = held.get(source.path)
        fd = opened.reopen() if opened is not None else open_regular(Path(source.path))
        with open(fd, "rb", buffering=0) as f:
            if SourceFile.of(source.path, os.fstat(f.fileno())) != source:
                raise CheckpointError(
                    f"{source.path} changed since its headers were read; attach again once the "
                    "file is final"
                )
            os.posix_fadvise(f.fileno(), span.offset, span.nbytes, os.POSIX_FADV_SEQUENTIAL)
            try:
                for chunk in chunks(f.fileno(), span.offset, span.nbytes):
                    digest.update(chunk)
            except EOFError:
                return "short"
            if SourceFile.of(source.path, os.fstat(f.fileno())) != source:
                raise CheckpointError(
                    f"{source.path} changed while engramd compared it with its set; attach "
                    "again once the file is final"
                )
    return digest.label()
