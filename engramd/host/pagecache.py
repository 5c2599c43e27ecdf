"""How much of a file is in the page cache: cachestat(2), else mincore(2) over a mapping.

A disk-backed set's pages come and go with memory pressure; status shows the
bytes resident beside the set's size. Neither call reads the file or faults a
page in: cachestat (Linux 6.5) asks the page cache directly; mincore asks it
through a read-only mapping that is never touched.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from engramd.host.libc import libc, map_read_only

libc.syscall.restype = ctypes.c_long
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
#: cachestat's number on x86-64 and arm64 alike (Linux 6.5: the unified syscall numbers).
_SYS_CACHESTAT = 451


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


def resident_bytes(fd: int, offset: int, length: int) -> int:
    """Bytes of the file's range [offset, offset + length) in the page cache (whole pages)."""
    if length <= 0:
        return 0
    span = _Range(offset, length)
    found = _Stat()
    if libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(found), 0) == 0:
        return min(found.nr_cache * mmap.PAGESIZE, length)
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter that predates it
        raise OSError(err, os.strerror(err))
    return _mincore(fd, offset, length)


#: Bytes mincore looks at per mapping: its vector (a byte a page) stays at 256 KiB.
_WINDOW = 1 << 30


def _mincore(fd: int, offset: int, length: int) -> int:
    start = offset - offset % mmap.PAGESIZE
    end = offset + length
    resident = 0
    for at in range(start, end, _WINDOW):
        size = min(_WINDOW, end - at)
        address = map_read_only(fd, size, at)
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(address, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            # Bit 0 says resident; the kernel leaves the others zero.
            resident += (len(vec) - bytes(vec).count(0)) * mmap.PAGESIZE
        finally:
            libc.munmap(address, size)
    return min(resident, length)
