"""The pages that really back a set's files, as the kernel maps them (not as a mount option says).

Each file is mapped read-only and one byte of every 2 MiB is read: a file
page cache page that is part of a 2 MiB folio is then mapped by one PMD
(smaps: ShmemPmdMapped, FilePmdMapped), a hugetlbfs page by its own size
(KernelPageSize), and anything else by 4 KiB pages. One read per 2 MiB costs
about 0.1 s per 100 GiB, and the mapping goes away at once.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from engramd.host.libc import libc, map_read_only

_SMALL = 4096


def _pmd_size() -> int:
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


PMD_SIZE = _pmd_size()


@dataclass(frozen=True)
class PageCensus:
    """How a set's files are backed: bytes in all, bytes on huge pages, the huge page size."""

    nbytes: int = 0
    huge_bytes: int = 0
    huge_page_size: int = PMD_SIZE

    @property
    def page_size(self) -> int:
        """The page size backing most of the bytes."""
        return self.huge_page_size if 2 * self.huge_bytes >= max(self.nbytes, 1) else _SMALL


def census(fds: list[int]) -> PageCensus:
    """Map each file, touch one byte per 2 MiB, read the mappings' smaps, unmap."""
    mapped: list[tuple[int, int]] = []
    try:
        for fd in fds:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            try:
                addr = map_read_only(fd, size)
            except OSError as e:
                raise OSError(e.errno, f"mmap for the page census: {e.strerror}") from None
            mapped.append((addr, size))
            for offset in range(0, size, PMD_SIZE):
                ctypes.c_char.from_address(addr + offset).value  # noqa: B018 (the fault is the point)
        return _from_smaps(Path("/proc/self/smaps").read_text(), mapped)
    finally:
        for addr, size in mapped:
            libc.munmap(addr, size)


def _from_smaps(smaps: str, mapped: list[tuple[int, int]]) -> PageCensus:
    starts = {f"{addr:x}": size for addr, size in mapped}
    nbytes = sum(starts.values())
    huge = 0
    huge_size = PMD_SIZE
    fields: dict[str, int] = {}
    current = False

    def count() -> int:
        page = fields.get("KernelPageSize", 4) << 10
        if page > _SMALL:  # hugetlbfs: every page of the mapping is one of this size
            nonlocal huge_size
            huge_size = page
            return (fields.get("Shared_Hugetlb", 0) + fields.get("Private_Hugetlb", 0)) << 10
        return (fields.get("ShmemPmdMapped", 0) + fields.get("FilePmdMapped", 0)) << 10

    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            if current:
                huge += count()
            current = head.split("-")[0] in starts
            fields = {}
        elif current and head.endswith(":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                fields[head[:-1]] = int(parts[1])
    if current:
        huge += count()
    return PageCensus(nbytes, min(huge, nbytes), huge_size)
