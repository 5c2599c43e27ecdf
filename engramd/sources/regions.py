"""A set's memory mapped for NIXL: a staged set's (writable), or a published one's (read-only).

NIXL registers addresses, so the memory is mapped with mmap(2) through libc
(Python's mmap gives no address of a read-only mapping, and keeps buffer
exports that block its close). Mappings start at the file's block size (a
hugetlbfs file's huge page), as the workers' do.
"""

from __future__ import annotations

import ctypes
import os

from engramd.backings import StagedSet
from engramd.host.libc import libc, map_read_only


class Region:
    """One tensor's bytes, mapped: `address` is where its first byte is."""

    def __init__(self, fd: int, offset: int, nbytes: int, writable: bool) -> None:
        align = os.fstat(fd).st_blksize
        start = offset - offset % align
        self._skip = offset - start
        self._size = max(self._skip + nbytes, 1)
        self._base = map_read_only(fd, self._size, start, writable=writable)
        #: The tensor's first byte.
        self.address = self._base + self._skip
        self.nbytes = nbytes

    def view(self) -> memoryview:
        """The tensor's bytes (valid until `close`)."""
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.address)).cast("B")

    def close(self) -> None:
        """Unmap."""
        if self._base:
            libc.munmap(self._base, self._size)
            self._base = 0


def staged_regions(staged: StagedSet, sizes: list[int]) -> list[Region]:
    """Each tensor of a staged set mapped writable (its pages are reserved already).

    Raises NotImplementedError for a backing whose memory is no file.
    """
    regions: list[Region] = []
    try:
        for index, nbytes in enumerate(sizes):
            fd, offset = staged.memory(index)
            regions.append(Region(fd, offset, nbytes, writable=True))
    except BaseException:
        close_all(regions)
        raise
    return regions


def close_all(regions: list[Region]) -> None:
    """Unmap every region."""
    for region in regions:
        region.close()
