"""The C library calls Python's os and mmap modules lack: mappings by address, mlock, mount.

Python's mmap cannot mlock, gives no address of a read-only mapping, and has
no munmap of its own; mount(2) and umount2(2) have no wrapper in os. One
handle with the prototypes declared once, for every module that needs them.
"""

from __future__ import annotations

import ctypes
import mmap
import os

# The C library the interpreter already links, as numa.py reaches it: finding it by
# name (ctypes.util.find_library) would run `ldconfig -p` at every daemon start.
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]

#: statfs(2) f_type of the filesystems that keep files in memory (linux/magic.h).
TMPFS_MAGIC, RAMFS_MAGIC, HUGETLBFS_MAGIC = 0x01021994, 0x858458F6, 0x958458F6


def filesystem_type(path: str | os.PathLike[str]) -> int:
    """statfs(2)'s f_type of the filesystem that holds `path` (one call, no mountinfo)."""
    # struct statfs starts with f_type, a long on every Linux ABI engramd runs on.
    buf = ctypes.create_string_buffer(256)
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def map_read_only(
    fd: int, size: int, offset: int = 0, writable: bool = False, populate: bool | None = None
) -> int:
    """The address of a shared read-only mapping of `size` bytes of `fd` from `offset`.

    `writable`: mapped read-write instead, its page tables filled at once (a staged
    set a transfer engine fills: its pages are reserved already, and a fault per 4 KiB
    page in the middle of a transfer costs more than one populating call).
    `populate`: fill its page tables at once all the same (default: when writable).
    Raises OSError with the kernel's reason; `libc.munmap(addr, size)` undoes it.
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    populate = writable if populate is None else populate
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    addr = libc.mmap(None, size, prot, flags, fd, offset)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(addr)
