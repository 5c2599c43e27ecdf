"""A set's pages reserved on several threads, one file too (engramd.host.reserve): every
page allocated, and memory that runs out is an error, never a SIGBUS."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import engramd.host.reserve as reserve
from conftest import huge_pages, mounted_hugetlbfs, mounted_tmpfs
from engramd.host.libc import TMPFS_MAGIC, filesystem_type
from engramd.host.pagecache import resident_bytes

MiB = 1 << 20


def _allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_one_memfd_is_reserved_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reserve, "SLICE_BYTES", 4 * MiB)
    seen: set[int] = set()
    populate = reserve._populate
    # The first slice of each thread waits for another thread's: one thread cannot take
    # every slice before the others start, however the machine schedules them.
    together = threading.Barrier(2, timeout=60)

    def counted(fd: int, offset: int, length: int) -> None:
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            if len(seen) <= 2:
                together.wait()
        populate(fd, offset, length)

    monkeypatch.setattr(reserve, "_populate", counted)
    fd = os.memfd_create("reserve-test", os.MFD_CLOEXEC)
    try:
        reserve.reserve_files([(fd, 48 * MiB + 4096)], mmap.PAGESIZE, populate=True, threads=4)
        assert os.fstat(fd).st_size == 48 * MiB + 4096
        assert _allocated(fd) == 48 * MiB + 4096
        assert len(seen) > 1, "one thread reserved the whole file"
    finally:
        os.close(fd)


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "fallocated"])
def test_a_full_tmpfs_is_an_error_not_a_sigbus(populate: bool) -> None:
    with mounted_tmpfs("8m") as shm:
        fds = [os.open(shm / f"t{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(2)]
        try:
            with pytest.raises(OSError) as e:
                reserve.reserve_files(
                    [(fds[0], 6 * MiB), (fds[1], 6 * MiB)], mmap.PAGESIZE, populate=populate
                )
            assert e.value.errno == errno.ENOSPC
            assert "no memory left for the set's pages" in str(e.value)
        finally:
            for fd in fds:
                os.close(fd)


def test_a_disk_file_gets_blocks_and_no_dirty_pages(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) == TMPFS_MAGIC:
        pytest.skip(f"{tmp_path} is on a tmpfs here, not a disk")
    fd = os.open(tmp_path / "t", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve.reserve_files([(fd, 16 * MiB)], mmap.PAGESIZE, on_disk=True, populate=True)
        assert os.fstat(fd).st_size == 16 * MiB and _allocated(fd) >= 16 * MiB
        # No page was touched: nothing of it is in the page cache to write back.
        assert resident_bytes(fd, 0, 16 * MiB) == 0
    finally:
        os.close(fd)


def test_huge_pages_beyond_the_pool_are_an_error_and_within_it_all_allocated() -> None:
    with huge_pages(2 * MiB, 4) as granted, mounted_hugetlbfs(2 * MiB) as shm:
        if granted < 4:
            pytest.skip(f"the kernel granted {granted} of 4 huge pages")
        free = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        beyond = (int(free.read_text()) + 1) * 2 * MiB
        fd = os.open(shm / "packed", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as e:
                reserve.reserve_files([(fd, beyond)], 2 * MiB, hugetlb=True)
            assert e.value.errno == errno.ENOSPC
            os.ftruncate(fd, 0)
            reserve.reserve_files([(fd, 8 * MiB)], 2 * MiB, hugetlb=True)
            assert _allocated(fd) == 8 * MiB
        finally:
            os.close(fd)


@pytest.mark.parametrize("cores", [1, 64])
def test_shmem_files_are_populated_from_populate_cores_and_hugetlb_ones_always(
    cores: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reserve, "cores", lambda: cores)
    monkeypatch.setattr(reserve, "SLICE_BYTES", 4 * MiB)
    calls: list[tuple[str, int]] = []
    for name in ("_populate", "_fallocate"):
        real = getattr(reserve, name)

        def counted(fd: int, offset: int, length: int, name: str = name, real: Any = real) -> None:
            calls.append((name, length))
            real(fd, offset, length)

        monkeypatch.setattr(reserve, name, counted)
    fds = [os.memfd_create(f"reserve-{i}", os.MFD_CLOEXEC) for i in range(2)]
    try:
        reserve.reserve_files([(fds[0], 16 * MiB), (fds[1], 8 * MiB)], mmap.PAGESIZE)
        if cores >= reserve.POPULATE_CORES:
            assert sorted(calls) == [("_populate", 4 * MiB)] * 6
        else:
            # One fallocate a file, each on a thread of its own.
            assert sorted(calls) == [("_fallocate", 8 * MiB), ("_fallocate", 16 * MiB)]
        assert [_allocated(fd) for fd in fds] == [16 * MiB, 8 * MiB]
    finally:
        for fd in fds:
            os.close(fd)
