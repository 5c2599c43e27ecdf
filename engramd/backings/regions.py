"""A set's memory mapped for a transfer: in the daemon read-only, to digest what landed; in
the transfer process writable (its landing ring) or read-only (a published set).

NIXL registers addresses, so the memory is mapped with mmap(2) through libc
(Python's mmap gives no address of a read-only mapping, and keeps buffer
exports that block its close). Mappings start and end at the file's block
size (a hugetlbfs file's huge page), as the workers' do.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

from engramd.host.libc import libc, map_read_only

if TYPE_CHECKING:
    from engramd.backings import StagedSet


class Region:
    """One tensor's bytes, mapped: `address` is where its first byte is.

    The daemon maps a staged set read-only, to digest what landed (landing.py
    writes it); a transfer process maps its landing ring writable and a served
    set read-only (nixlxfer.Agent.attach).
    """

    def __init__(
        self,
        fd: int,
        offset: int,
        nbytes: int,
        writable: bool = False,
        populate: bool | None = None,
    ) -> None:
        align = os.fstat(fd).st_blksize
        start = offset - offset % align
        self._skip = offset - start
        # Whole blocks: a hugetlb mapping cannot be unmapped in part of a huge page.
        self._size = -(-max(self._skip + nbytes, 1) // align) * align
        self._base = map_read_only(fd, self._size, start, writable, populate)
        #: The tensor's first byte.
        self.address = self._base + self._skip
        self.nbytes = nbytes
        #: The file (kept open) and where the tensor lies in it, for a transfer process
        #: to map it too.
        self.fd = os.dup(fd)
        self.offset = offset

    def view(self) -> memoryview:
        """The tensor's bytes (valid until `close`)."""
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.address)).cast("B")

    def close(self) -> None:
        """Unmap."""
        if self._base:
            if libc.munmap(self._base, self._size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"munmap of a set's tensor: {os.strerror(err)}")
            self._base = 0
            os.close(self.fd)


def staged_regions(staged: StagedSet, sizes: list[int]) -> list[Region]:
    """Each tensor of a staged set mapped read-only, its pages not touched: a fill writes
    them with write(2) (landing.py), which fills a reserved tmpfs page without zeroing it
    first, where a fault of this mapping before the write would zero it for nothing (about
    0.25 CPU-s a GiB here); the digests read each page after it was written.

    Raises NotImplementedError for a backing whose memory is no file.
    """
    regions: list[Region] = []
    try:
        for index, nbytes in enumerate(sizes):
            fd, offset = staged.memory(index)
            regions.append(Region(fd, offset, nbytes, populate=False))
    except BaseException:
        close_all(regions)
        raise
    return regions


def close_all(regions: list[Region]) -> None:
    """Unmap every region."""
    for region in regions:
        region.close()
