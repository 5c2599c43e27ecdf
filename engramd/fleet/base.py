"""What every source shares: its failure and the checks it runs."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from engramd_shared.checkpoint import TablePlan
from engramd_shared.fileid import open_regular
from engramd_shared.headers import TensorEntry

#: Bytes a source moves per NIXL request: large enough that per-request costs
#: vanish, small enough that progress, the cancel flag and the rate floor are
#: looked at often.
WINDOW_BYTES = 64 << 20
#: Random ranges of each tensor compared with the node's own checkpoint after a fill.
SPOT_CHECKS = 8
SPOT_BYTES = 4096


class SourceFailed(Exception):
    """A source could not give the set; the message says why, in one line. The next one runs."""


def windows(nbytes: int) -> list[tuple[int, int]]:
    """(offset, size) pieces of WINDOW_BYTES covering `nbytes`."""
    return [(at, min(WINDOW_BYTES, nbytes - at)) for at in range(0, nbytes, WINDOW_BYTES)]


def spans(entry: TensorEntry) -> list[tuple[TensorEntry, int]]:
    """The checkpoint tensors a tensor is made of (one, or its row shards back to back),
    each with the offset of its first byte in the tensor."""
    found, at = [], 0
    for span in entry.spans:
        found.append((span, at))
        at += span.nbytes
    return found


def overlaps(entry: TensorEntry, at: int, nbytes: int) -> list[tuple[TensorEntry, int, int, int]]:
    """Where bytes `at`..`at + nbytes` of a tensor lie in the checkpoint: (span, offset in the
    span's file, bytes, offset in the range) for each of its spans they overlap."""
    found = []
    for span, start in spans(entry):
        lo, hi = max(at, start), min(at + nbytes, start + span.nbytes)
        if lo < hi:
            found.append((span, span.offset + lo - start, hi - lo, lo - at))
    return found


def read_piece(entry: TensorEntry, at: int, nbytes: int) -> bytearray:
    """Bytes `at`..`at + nbytes` of a tensor, read from the checkpoint's files (its spans
    back to back); raises SourceFailed when a file is shorter than its header says."""
    out = bytearray(nbytes)
    view = memoryview(out)
    for span, offset, n, into in overlaps(entry, at, nbytes):
        fd = open_regular(Path(span.file))
        try:
            done = 0
            while done < n:
                got = os.preadv(fd, [view[into + done : into + n]], offset + done)
                if not got:
                    raise SourceFailed(f"{span.file} is shorter than its header says")
                done += got
        finally:
            os.close(fd)
    return out


def spot_check_set(plan: TablePlan, received: Sequence[memoryview]) -> None:
    """spot_check each received tensor of `plan`; none of a plan made from an object store,
    whose files are not on this node: its attested digests alone decide."""
    if plan.store:
        return
    for entry, view in zip(plan.tensors, received, strict=True):
        spot_check(entry, view)


def spot_check(entry: TensorEntry, received: memoryview) -> None:
    """Compare random ranges of a received tensor (and its first and last) with the files.

    The receiver picks the ranges after the bytes arrived, so a source cannot
    know which of its bytes are looked at: a source that changed more than a
    sliver of a tensor is caught, whatever checksum it claimed.
    """
    n = entry.nbytes
    if n == 0:
        return
    starts = {0, max(n - SPOT_BYTES, 0)}
    starts |= {secrets.randbelow(n) for _ in range(SPOT_CHECKS)}
    for span, start in spans(entry):
        mine = [at for at in starts if start <= at < start + span.nbytes]
        if not mine:
            continue
        fd = open_regular(Path(span.file))
        try:
            # Exactly the pages compared and no readahead around them: a fill must not
            # cost the node a read of its files, whatever the disk's readahead setting.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for at in sorted(mine):
                size = min(SPOT_BYTES, start + span.nbytes - at)
                if os.pread(fd, size, span.offset + at - start) != received[at : at + size]:
                    raise SourceFailed(
                        f"tensor {entry.name!r}: bytes {at}-{at + size} differ from "
                        f"{span.file}: the source sent other bytes than the checkpoint holds"
                    )
        finally:
            os.close(fd)
