"""Copy a table set from its checkpoint into a backing: open, reserve, copy, describe, publish.

0. Identify: each checkpoint file's identity (device, inode, size, mtime,
   ctime) is compared with what the plan read, by path before the load, by
   descriptor before and after each tensor's copy (regular files only), and
   by path again at the end. A file rewritten or replaced during the load is
   never published.
1. Reserve: the backing reserves every byte first (`Backing.stage`). A
   backing too small fails there, before a byte is copied, and a reserved
   page can never raise SIGBUS later in the daemon or in any worker. The
   pages are allocated here, under the NUMA placement (numa.py).
2. Copy: positional reads from the checkpoint into a small reused buffer,
   an XXH3-64 digest of the buffer while it is still in the CPU cache, a
   write through the backing; one thread per tensor, largest first, on
   several threads. The checkpoint is not mapped, so a file truncated under
   the daemon gives a short read (a clear error) instead of a SIGBUS.
   Measured by bench/ against sendfile, pwrite from a mapping and reads into
   a mapping: with the checksum, this is the fastest (a digest in a second
   pass reads every page again).
3. Describe and publish: the backing makes the set visible only once its
   manifest is complete (tmpfs: manifest.json last, then a rename). A crash
   at any point leaves either no set or a complete one.
"""

from __future__ import annotations

import os
import secrets
import threading
import time

from engramd.backings import Backing, StagedSet
from engramd.checksum import chunks, label, new_digest
from engramd.host.blocking import map_on_threads
from engramd.host.numa import Placement, applied
from engramd_client.core.checkpoint import (
    CheckpointError,
    SourceFile,
    TablePlan,
    TensorEntry,
    open_regular,
)
from engramd_client.core.layout import Manifest, ManifestTensor

DEFAULT_PLACEMENT = Placement()

# How often a copy thread reports progress and checks for cancellation.
PROGRESS_BYTES = 64 << 20


class LoadCancelled(Exception):
    """The daemon stopped while the load was running."""


class LoadProgress:
    """Bytes copied so far; updated by the copy threads, read by the service."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._done = 0
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.cancel = threading.Event()

    @property
    def done(self) -> int:
        """Bytes copied so far."""
        return self._done

    def add(self, n: int) -> None:
        """Count `n` more bytes copied; raise LoadCancelled if the load was cancelled."""
        with self._lock:
            self._done += n
        if self.cancel.is_set():
            raise LoadCancelled("the daemon is stopping")


def load_set(
    plan: TablePlan,
    backing: Backing,
    threads: int,
    progress: LoadProgress,
    placement: Placement = DEFAULT_PLACEMENT,
    node: int | None = None,
) -> Manifest:
    """Copy the plan's tensors into `backing`, publish the set and return its manifest.

    The backing reserves (allocates) every page in this thread, under
    `placement`; a copy kept for NUMA `node` (--numa per-node) is bound there.
    """
    sources = {s.path: s for s in plan.sources}
    for source in plan.sources:
        _check_identity(source, os.stat(source.path), "since its headers were read")
    with applied(placement.for_copy(node)):
        staged = backing.stage(plan, node)
    try:
        order = sorted(range(len(plan.tensors)), key=lambda i: -plan.tensors[i].nbytes)

        def copy(i: int) -> str:
            entry = plan.tensors[i]
            return _copy(entry, sources[str(entry.file)], staged, i, progress)

        sums = dict(zip(order, map_on_threads(copy, order, threads, "load"), strict=True))
        for source in plan.sources:
            _check_identity(source, os.stat(source.path), "during the load (replaced)")
        manifest = Manifest(
            set_id=plan.set_id,
            fingerprint=plan.fingerprint,
            nonce=secrets.token_hex(16),
            checkpoint=str(plan.checkpoint),
            selection=plan.selection,
            created=time.time(),
            tensors=tuple(
                ManifestTensor(
                    name=t.name,
                    dtype=t.dtype,
                    shape=t.shape,
                    file=staged.placement(i)[0],
                    offset=staged.placement(i)[1],
                    nbytes=t.nbytes,
                    checksum=sums[i],
                )
                for i, t in enumerate(plan.tensors)
            ),
            sources=plan.sources,
            node=node,
        )
        staged.publish(manifest)
        return manifest
    except BaseException:
        staged.discard()
        raise


def _check_identity(source: SourceFile, st: os.stat_result, when: str) -> None:
    now = SourceFile.of(source.path, st)
    if now != source:
        raise CheckpointError(
            f"{source.path} changed {when} (size {source.size} -> {now.size}, inode "
            f"{source.ino} -> {now.ino}, mtime_ns {source.mtime_ns} -> {now.mtime_ns}); "
            "engramd never serves a copy of a file that changed under it: load it again "
            "once the file is final"
        )


def _copy(
    entry: TensorEntry, source: SourceFile, staged: StagedSet, index: int, progress: LoadProgress
) -> str:
    # A descriptor of its own per copy: the kernel keeps readahead state per
    # open file, and two threads streaming one shared descriptor at different
    # offsets defeat it (measured: cold loads at half the speed).
    digest = new_digest()
    done = unreported = 0
    with open(open_regular(entry.file), "rb", buffering=0) as src:
        _check_identity(source, os.fstat(src.fileno()), "during the load")
        os.posix_fadvise(src.fileno(), entry.offset, entry.nbytes, os.POSIX_FADV_SEQUENTIAL)
        try:
            for chunk in chunks(src.fileno(), entry.offset, entry.nbytes):
                digest.update(chunk)
                staged.write(index, chunk, done)
                done += len(chunk)
                unreported += len(chunk)
                if unreported >= PROGRESS_BYTES or done == entry.nbytes:
                    progress.add(unreported)
                    unreported = 0
        except EOFError:
            raise CheckpointError(
                f"{entry.file}: tensor {entry.name!r}: the file ended while it was "
                "being loaded (truncated or rewritten); fetch the file again"
            ) from None
        _check_identity(source, os.fstat(src.fileno()), "during the load")
    return label(digest)
