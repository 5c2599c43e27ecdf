"""Files out of the page cache: what the tests or the bench read next comes from the disk."""

from __future__ import annotations

import os
from pathlib import Path

from engramd.host.pagecache import resident_bytes


def evict(folder: Path, pattern: str = "*") -> None:
    """Write back, then drop from the page cache, every file under `folder` (at any depth)
    whose name matches `pattern`: pages no process maps leave the cache."""
    for path in sorted(folder.rglob(pattern)):
        if path.is_file():
            evict_file(path)


def evict_file(path: Path) -> None:
    """Write back, then drop from the page cache, the file at `path`: pages no process maps
    leave the cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(folder: Path, pattern: str = "*") -> int:
    """Bytes of the files under `folder` (at any depth) whose name matches `pattern` that are
    in the page cache now."""
    total = 0
    for path in sorted(folder.rglob(pattern)):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                total += resident_bytes(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)
    return total
