"""Files out of the page cache: what the tests or the bench read next comes from the disk."""

from __future__ import annotations

import os
from pathlib import Path


def evict(folder: Path, pattern: str = "*") -> None:
    """Write back, then drop from the page cache, every file under `folder` (at any depth)
    whose name matches `pattern`: pages no process maps leave the cache."""
    for path in sorted(folder.rglob(pattern)):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
