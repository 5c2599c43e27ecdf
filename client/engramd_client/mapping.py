"""Tensors over memory: read-only mappings of the daemon's files, or private copies.

Both paths hand out CPU tensors that view their memory without a copy. A
shared tensor views a PROT_READ mapping: a write through it faults (SIGSEGV)
instead of changing the table for every worker. A private tensor views a
private anonymous mapping of exactly the tensor's bytes (rounded to a page),
filled with positional reads from the checkpoint; no caching allocator rounds
it up. Like the engines' private tables it is the process's own memory (not
Shmem), on transparent huge pages where the kernel gives them (`use_thp`).
Rows an engine pads a table with past its end (`pad_rows`) are zero pages
of the worker's own, right after the shared pages, in one range of
addresses (`padded_mapping`). Every handle kind (handles.py, cumem.py) and
`Tables` (tables.py) build on these primitives, which import nothing else
of the worker's library.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from engramd_shared.errors import CheckpointError
from engramd_shared.headers import DTYPES, TensorEntry

#: {tensor name: (first row, end row)} to map only a row range (a TP shard).
RowRanges = Mapping[str, tuple[int, int]]

_READ_CHUNK = 256 << 20

#: What a tensor's bytes are viewed through: a mapping, or one range made of
#: several mappings (padded_mapping).
Buffer = mmap.mmap | ctypes.Array[ctypes.c_ubyte]

# Linux's mmap flags the mmap module does not name.
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        dtype = getattr(torch, DTYPES[name][1])
    except (KeyError, AttributeError):
        raise CheckpointError(
            f"dtype {name!r} is not supported by this torch {torch.__version__}"
        ) from None
    assert isinstance(dtype, torch.dtype)
    return dtype


@dataclass(frozen=True)
class Region:
    """Bytes of one tensor to map: `length` bytes at `offset` of `path`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int
    length: int
    #: Bytes of zero rows after the region's `length` (an engine's padding past the end).
    pad: int = 0

    def cut(self, rows: RowRanges | None, pad_rows: bool = False) -> Region:
        """This region narrowed to its row range in `rows` (itself when it has none).

        `pad_rows`: a range may run past the tensor's last row; those rows are zeros.
        """
        if rows is None or self.name not in rows:
            return self
        start, stop = rows[self.name]
        end = self.shape[0] if self.shape else 0
        if not self.shape or not 0 <= start <= stop or (stop > end and not pad_rows):
            raise ValueError(
                f"rows[{self.name!r}] = ({start}, {stop}) is outside the tensor's "
                f"{self.shape[0] if self.shape else 0} rows"
            )
        row_bytes = _row_bytes(self)
        held = max(0, min(stop, end) - start)
        return replace(
            self,
            shape=(stop - start, *self.shape[1:]),
            offset=self.offset + min(start, end) * row_bytes,
            length=held * row_bytes,
            pad=(stop - start - held) * row_bytes,
        )


def _row_bytes(region: Region) -> int:
    """Bytes of one row of a region's tensor, from its dtype and row shape."""
    n = DTYPES[region.dtype][0]
    for d in region.shape[1:]:
        n *= d
    return n


def check_row_names(rows: RowRanges | None, names: list[str]) -> None:
    """Raise ValueError when `rows` names a tensor that is not selected."""
    unknown = sorted(set(rows or ()) - set(names))
    if unknown:
        raise ValueError(f"rows names tensors that are not selected: {unknown}")


def _view(buffer: Buffer, delta: int, region: Region) -> torch.Tensor:
    dtype = torch_dtype(region.dtype)
    if region.length + region.pad == 0:
        return torch.empty(region.shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer gives a tensor it cannot protect;
        # the mapping itself is PROT_READ, so the kernel protects it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(
            buffer, dtype=torch.uint8, count=region.length + region.pad, offset=delta
        )
    return flat.view(dtype).view(region.shape)


def map_fd(fd: int, region: Region, populate: bool, writable: bool = False) -> torch.Tensor:
    """Map a region of a read-only descriptor PROT_READ and view it as a tensor; closes `fd`.

    Every handle kind ends here (engramd_client.handles). `populate` fills the
    page tables now (MAP_POPULATE), so the first lookups do not take a page
    fault per page touched. `writable`: a writable descriptor mapped
    PROT_READ | PROT_WRITE, for a GPU that registers only writable memory
    (the daemon's --allow-writable-gpu-mappings).
    """
    try:
        if region.length == 0:
            return _padding(region)
        st = os.fstat(fd)
        if region.offset + region.length > st.st_size:
            raise OSError(
                f"{region.path} is {st.st_size} bytes, the handle needs "
                f"{region.offset + region.length}"
            )
        # A mapping starts at a page of the file: a huge page on hugetlbfs, whose
        # block size says so.
        page = max(mmap.ALLOCATIONGRANULARITY, st.st_blksize)
        start = region.offset - region.offset % page
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        if region.pad:
            buffer: Buffer = padded_mapping(fd, region, start, page, flags, prot)
        else:
            buffer = mmap.mmap(
                fd, region.offset + region.length - start, flags=flags, prot=prot, offset=start
            )
    finally:
        os.close(fd)
    return _view(buffer, region.offset - start, region)


def padded_mapping(
    fd: int, region: Region, start: int, page: int, flags: int, prot: int
) -> ctypes.Array[ctypes.c_ubyte]:
    """The region's file pages from `start`, then its zero rows, as one range of addresses.

    The file's whole pages up to the region's end are mapped shared (`flags`,
    `prot`); the bytes of its last partial page are copied, so that what
    follows the region in the file never shows as padding; the padding rows
    are zero pages of the worker's own. Unmapped when the returned array is
    collected (a tensor viewing it keeps it).
    """
    delta = region.offset - start
    size = delta + region.length + region.pad
    # Whole pages of the file are shared: huge ones on hugetlbfs, else the CPU's.
    split = page if _on_hugetlbfs(fd) else mmap.PAGESIZE
    shared = (delta + region.length) // split * split
    # Room to start the file's mapping at a page of its own size (a huge page on hugetlbfs).
    reserve = size + page
    raw = _libc.mmap(
        None,
        reserve,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
        -1,
        0,
    )
    if raw in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"cannot reserve {reserve} bytes for {region.name}")
    base = -(-raw // page) * page
    try:
        if shared and _libc.mmap(base, shared, prot, flags | _MAP_FIXED, fd, start) != base:
            raise OSError(ctypes.get_errno(), f"cannot map {region.path}")
        tail = delta + region.length - shared
        if tail:
            copied = (ctypes.c_ubyte * tail).from_address(base + shared)
            if os.preadv(fd, [memoryview(copied)], start + shared) != tail:
                raise OSError(f"{region.path} ended before its last rows")
        if _libc.mprotect(base + shared, raw + reserve - base - shared, prot) != 0:
            raise OSError(ctypes.get_errno(), f"cannot protect the padding of {region.name}")
    except BaseException:
        _libc.munmap(raw, reserve)
        raise
    array = (ctypes.c_ubyte * size).from_address(base)
    weakref.finalize(array, _libc.munmap, raw, reserve)
    return array


class _Statfs(ctypes.Structure):
    # struct statfs begins with f_type (a long on Linux); the rest is not read.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]


HUGETLBFS_MAGIC = 0x958458F6


def _on_hugetlbfs(fd: int) -> bool:
    """Whether `fd` is a file of a hugetlbfs (mapped only in whole huge pages)."""
    found = _Statfs()
    return _libc.fstatfs(fd, ctypes.byref(found)) == 0 and found.f_type == HUGETLBFS_MAGIC


def _padding(region: Region) -> torch.Tensor:
    """A region of padding rows only: zeros of the worker's own."""
    return torch.zeros(region.shape, dtype=torch_dtype(region.dtype))


def load_private(
    entry: TensorEntry, rows: RowRanges | None, thp: bool = True, pad_rows: bool = False
) -> torch.Tensor:
    """Read a tensor (or its row range) from the checkpoint into private memory.

    A table joined from row shards is read shard by shard, back to back;
    with `pad_rows`, rows past its end are zeros.

    `thp`: ask for transparent huge pages (MADV_HUGEPAGE) before the pages are
    touched (a kernel with THP "never" gives 4 KiB pages); else refuse them
    (MADV_NOHUGEPAGE), even where THP is "always".
    """
    region = Region(entry.name, entry.dtype, entry.shape, str(entry.file), 0, entry.nbytes).cut(
        rows, pad_rows
    )
    if region.length + region.pad == 0:
        return torch.empty(region.shape, dtype=torch_dtype(region.dtype))
    # MAP_PRIVATE: a private copy is this process's memory, not shared memory
    # (Python's default for -1 is a shared mapping, which counts as Shmem).
    # Padding rows stay the mapping's zero pages.
    buffer = mmap.mmap(-1, region.length + region.pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE if thp else mmap.MADV_NOHUGEPAGE)
    view = memoryview(buffer)
    try:
        at = 0
        for span in entry.spans:
            # The span's bytes that fall in the region, at the tensor's byte `at`.
            begin = max(region.offset, at)
            end = min(region.offset + region.length, at + span.nbytes)
            if begin < end:
                _read_into(view[begin - region.offset : end - region.offset], span, begin - at)
            at += span.nbytes
    finally:
        view.release()
    return _view(buffer, 0, region)


def _read_into(view: memoryview, span: TensorEntry, at: int) -> None:
    """Fill `view` with the bytes of checkpoint tensor `span` from its byte `at` on."""
    with open(span.file, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            chunk = view[done : done + _READ_CHUNK]
            n = os.preadv(f.fileno(), [chunk], span.offset + at + done)
            chunk.release()
            if n == 0:
                raise CheckpointError(
                    f"{span.file}: tensor {span.name!r}: file ends before its data "
                    "(truncated file); fetch the file again"
                )
            done += n
