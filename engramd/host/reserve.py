"""Allocate every page of a set's files on several threads, one file included.

posix_fallocate on tmpfs, a memfd or hugetlbfs holds the file's inode lock
for the whole call, so one file (a memfd or hugetlbfs set, a 94 GiB tensor
of a tmpfs set) reserves on one core. On shmem (tmpfs, memfd) it only
allocates, about 4.6 GB/s of 4 KiB pages here, and leaves the zeroing to
the copy's first touch, on every copy thread, behind the reads; hugetlbfs
also clears each huge page under that lock. Populating instead (each
thread maps a slice of the file shared and populates it for writing,
MADV_POPULATE_WRITE, Linux 5.14: faults in different parts of a file take
no common lock) allocates and zeroes about 1.3 GB/s a core here, before the
reads. So hugetlb files are always populated, and shmem files where the
machine has POPULATE_CORES cores or more (there twice one fallocate's
rate); with fewer, each file is fallocated on a thread of its own.

A page that cannot be had fails the populating call (EFAULT where a store
would raise SIGBUS: a full tmpfs, an empty huge-page pool; ENOMEM: the
memory cgroup) instead of sending a signal, so a set that does not fit
still fails here, before a byte is copied; both are raised as ENOSPC.
hugetlbfs reserves a shared mapping's pages at mmap, which fails with
ENOMEM when the pool is short. Every thread allocates under the caller's
memory policy (numa.following), as the caller would. A kernel without
MADV_POPULATE_WRITE (EINVAL) gets posix_fallocate, slice by slice, and a
disk's files (the disk backing) always do: there it allocates blocks,
where touching the pages would write every one of them back to the disk.
"""

from __future__ import annotations

import ctypes
import errno
import os

from engramd.host.blocking import cores, map_on_threads
from engramd.host.libc import libc, map_read_only
from engramd.host.numa import following, thread_policy

libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23

#: Bytes a thread populates at a time (whole pages): small enough that one large file
#: keeps every thread busy to its end, large enough that a mapping per slice is cheap.
SLICE_BYTES = 256 << 20
#: Cores from which shmem files are populated rather than fallocated (see above).
POPULATE_CORES = 8


def reserve_files(
    files: list[tuple[int, int]],
    page_size: int,
    *,
    hugetlb: bool = False,
    on_disk: bool = False,
    populate: bool | None = None,
    threads: int = 0,
) -> None:
    """Allocate the first `size` bytes of each `(fd, size)` on `threads` threads (0: a core
    each); for `hugetlb` files each size a multiple of `page_size`.

    Files are grown to their size first (a mapping past the end of a file cannot be
    populated). `on_disk`: the files are a disk's, their blocks are allocated instead.
    `populate`: populate slices (True) or fallocate whole files (False); None: as the
    pages and the machine's cores say. Raises OSError(ENOSPC) where memory (or the
    disk) ran out.
    """
    if populate is None:
        populate = hugetlb or cores() >= POPULATE_CORES
    populate = populate and not on_disk
    slices = []
    for fd, size in files:
        # A file fallocated in one call: its extents as contiguous as its file system can.
        step = max(page_size, SLICE_BYTES // page_size * page_size) if populate else size
        slices += [(fd, at, min(step, size - at)) for at in range(0, size, max(step, 1))]
    for fd, size in files:
        if size and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
    policy = thread_policy()

    def reserve(piece: tuple[int, int, int]) -> None:
        with following(policy):
            (_populate if populate else _fallocate)(*piece)

    map_on_threads(reserve, slices, threads or cores(), "reserve")


def _populate(fd: int, offset: int, length: int) -> None:
    try:
        addr = map_read_only(fd, length, offset, writable=True, populate=False)
    except OSError as e:
        raise _ran_out(e) from None
    try:
        if libc.madvise(addr, length, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
    finally:
        libc.munmap(addr, length)
    if err == errno.EINVAL:
        _fallocate(fd, offset, length)
        return
    raise _ran_out(OSError(err, os.strerror(err)))


def _fallocate(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        raise _ran_out(e) from None


def _ran_out(e: OSError) -> OSError:
    if e.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
        return OSError(errno.ENOSPC, f"no memory left for the set's pages ({e.strerror})")
    return e
