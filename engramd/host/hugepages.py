"""The kernel's pools of huge pages (hugetlb) and writing into memory that has no write().

hugetlbfs files and MFD_HUGETLB memfds take their pages from a pool per page
size, reserved ahead (`nr_hugepages`), and accept data only through a
mapping: offsets and lengths in whole huge pages, no write(2).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from engramd.units import gib
from engramd_shared.topology import NODES

HUGEPAGES = Path("/sys/kernel/mm/hugepages")


@dataclass(frozen=True)
class Pool:
    """The hugetlb pool of one page size (on one NUMA node, or all), in bytes."""

    page_size: int
    total: int
    free: int
    #: The NUMA node whose pool this is, or None for the whole machine's.
    node: int | None = None

    @property
    def sysfs(self) -> Path:
        """The pool's folder: nr_hugepages, free_hugepages."""
        kb = f"hugepages-{self.page_size >> 10}kB"
        return HUGEPAGES / kb if self.node is None else NODES / f"node{self.node}/hugepages/{kb}"

    def fix(self, needed: int) -> str:
        """How an operator gives this pool `needed` bytes."""
        pages = -(-needed // self.page_size)
        return (
            f"reserve at least {pages} pages of {gib(self.page_size)} "
            f"(echo {pages} > {self.sysfs / 'nr_hugepages'}, vm.nr_hugepages for 2 MiB pages, "
            f"or the kernel parameters hugepagesz= hugepages= at boot: 1 GiB pages are rarely "
            "granted at run time) and mount hugetlbfs with that pagesize"
        )


def pool(page_size: int, node: int | None = None) -> Pool:
    """The pool of `page_size` pages (on `node`): all of it, and what is neither used nor promised.

    Pages promised to mappings (resv_hugepages) are counted only machine-wide.
    """
    folder = Pool(page_size, 0, 0, node).sysfs

    def read(name: str) -> int:
        try:
            return int((folder / name).read_text())
        except (OSError, ValueError):
            return 0

    free = max(read("free_hugepages") - read("resv_hugepages"), 0)
    return Pool(page_size, read("nr_hugepages") * page_size, free * page_size, node)


#: Huge page sizes a memfd may ask for (MFD_HUGETLB), with their flags.
MEMFD_PAGE_SIZES = {2 << 20: os.MFD_HUGE_2MB, 1 << 30: os.MFD_HUGE_1GB}


class MappedWriter:
    """Writes into a file through a shared mapping of all of it (hugetlb has no write())."""

    def __init__(self, fd: int, size: int) -> None:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)

    def write(self, data: memoryview | bytes, offset: int) -> None:
        """Copy `data` to `offset` of the file."""
        self._map[offset : offset + len(data)] = data

    def close(self) -> None:
        """Unmap (the pages stay in the file)."""
        self._map.close()


def fs_page_size(folder: str | os.PathLike[str]) -> int:
    """The page size of a hugetlbfs mount (its block size)."""
    return os.statvfs(folder).f_bsize
