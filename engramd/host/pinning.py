"""Lock a set's pages in memory so the tables are never swapped out.

The daemon maps each tensor file read-only and mlocks the mapping for as long
as it holds the set. Python's mmap cannot mlock, and taking the address of
its buffer needs a writable mapping, so the mapping is made through libc.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from pathlib import Path

from engramd.host.libc import libc, map_read_only

log = logging.getLogger("engramd")


FIX_MEMLOCK = (
    "raise the daemon's locked-memory limit (systemd LimitMEMLOCK=infinity, "
    "ulimit -l unlimited, or CAP_IPC_LOCK)"
)


class PinnedFiles:
    """Read-only, mlocked mappings of a set's files; unmapped by `release()`.

    `pin` and `release` run on different threads: a set may be dropped while
    one of its files is being locked. Whatever `pin` maps after `release` is
    unmapped at once, so a dropped set never stays locked in the daemon.
    """

    def __init__(self) -> None:
        self._maps: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._released = False
        #: Why locking a file failed (the first failure), or None.
        self.error: str | None = None

    def pin(self, path: Path, offset: int, length: int) -> None:
        """Map `length` bytes at `offset` of `path` read-only and lock them.

        Records the failure instead of raising.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self._fail(f"open {path}: {e.strerror}")
            return
        try:
            self.pin_fd(fd, offset, length, str(path))
        finally:
            os.close(fd)

    def pin_fd(self, fd: int, offset: int, length: int, what: str) -> None:
        """Map `length` bytes at `offset` of `fd` read-only and lock them (as `pin`).

        The mapping starts at the file's page boundary (its block size: a huge
        page on hugetlbfs).
        """
        granularity = max(mmap.ALLOCATIONGRANULARITY, os.fstat(fd).st_blksize)
        start = offset - offset % granularity
        size = offset + length - start
        if length == 0 or self._released:
            return
        try:
            addr = map_read_only(fd, size, start)
        except OSError as e:
            self._fail(f"mmap {what}: {e.strerror}")
            return
        if libc.mlock(addr, size) != 0:
            self._fail(f"mlock {what} ({size} bytes): {os.strerror(ctypes.get_errno())}")
            libc.munmap(addr, size)
            return
        with self._lock:
            if not self._released:
                self._maps.append((addr, size))
                return
        libc.munmap(addr, size)

    def _fail(self, error: str) -> None:
        if self.error is None:
            self.error = error

    def release(self) -> None:
        """Unmap (and so unlock) every file; later pins unmap at once."""
        with self._lock:
            self._released = True
            maps, self._maps = self._maps, []
        for addr, size in maps:
            libc.munmap(addr, size)
