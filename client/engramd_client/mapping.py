"""Tensors over memory: read-only mappings of the daemon's files, or private copies.

Both paths hand out CPU tensors that view their memory without a copy. A
shared tensor views a PROT_READ mapping: a write through it faults (SIGSEGV)
instead of changing the table for every worker. A private tensor views a
private anonymous mapping of exactly the tensor's bytes (rounded to a page),
filled with positional reads from the checkpoint; no caching allocator rounds
it up. Like the engines' private tables it is the process's own memory (not
Shmem), on transparent huge pages where the kernel gives them (`use_thp`).
Every handle kind (handles.py, cumem.py) and `Tables` (tables.py) build on
these primitives, which import nothing else of the worker's library.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from engramd_client.core.errors import CheckpointError
from engramd_client.core.headers import DTYPES, TensorEntry

#: {tensor name: (first row, end row)} to map only a row range (a TP shard).
RowRanges = Mapping[str, tuple[int, int]]

_READ_CHUNK = 256 << 20


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

    def cut(self, rows: RowRanges | None) -> Region:
        """This region narrowed to its row range in `rows` (itself when it has none)."""
        if rows is None or self.name not in rows:
            return self
        start, stop = rows[self.name]
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(
                f"rows[{self.name!r}] = ({start}, {stop}) is outside the tensor's "
                f"{self.shape[0] if self.shape else 0} rows"
            )
        row_bytes = self.length // self.shape[0] if self.shape[0] else 0
        return replace(
            self,
            shape=(stop - start, *self.shape[1:]),
            offset=self.offset + start * row_bytes,
            length=(stop - start) * row_bytes,
        )


def check_row_names(rows: RowRanges | None, names: list[str]) -> None:
    """Raise ValueError when `rows` names a tensor that is not selected."""
    unknown = sorted(set(rows or ()) - set(names))
    if unknown:
        raise ValueError(f"rows names tensors that are not selected: {unknown}")


def _view(buffer: mmap.mmap, delta: int, region: Region) -> torch.Tensor:
    dtype = torch_dtype(region.dtype)
    if region.length == 0:
        return torch.empty(region.shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer gives a tensor it cannot protect;
        # the mapping itself is PROT_READ, so the kernel protects it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=region.length, offset=delta)
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
            return torch.empty(region.shape, dtype=torch_dtype(region.dtype))
        st = os.fstat(fd)
        if region.offset + region.length > st.st_size:
            raise OSError(
                f"{region.path} is {st.st_size} bytes, the handle needs "
                f"{region.offset + region.length}"
            )
        # A mapping starts at a page of the file: a huge page on hugetlbfs, whose
        # block size says so.
        start = region.offset - region.offset % max(mmap.ALLOCATIONGRANULARITY, st.st_blksize)
        buffer = mmap.mmap(
            fd,
            region.offset + region.length - start,
            flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0),
            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
            offset=start,
        )
    finally:
        os.close(fd)
    return _view(buffer, region.offset - start, region)


def load_private(entry: TensorEntry, rows: RowRanges | None, thp: bool = True) -> torch.Tensor:
    """Read a tensor (or its row range) from the checkpoint into private memory.

    `thp`: ask for transparent huge pages (MADV_HUGEPAGE) before the pages are
    touched (a kernel with THP "never" gives 4 KiB pages); else refuse them
    (MADV_NOHUGEPAGE), even where THP is "always".
    """
    region = Region(
        entry.name, entry.dtype, entry.shape, str(entry.file), entry.offset, entry.nbytes
    ).cut(rows)
    if region.length == 0:
        return torch.empty(region.shape, dtype=torch_dtype(region.dtype))
    # MAP_PRIVATE: a private copy is this process's memory, not shared memory
    # (Python's default for -1 is a shared mapping, which counts as Shmem).
    buffer = mmap.mmap(-1, region.length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE if thp else mmap.MADV_NOHUGEPAGE)
    view = memoryview(buffer)
    try:
        with open(region.path, "rb", buffering=0) as f:
            done = 0
            while done < region.length:
                chunk = view[done : done + _READ_CHUNK]
                n = os.preadv(f.fileno(), [chunk], region.offset + done)
                chunk.release()
                if n == 0:
                    raise CheckpointError(
                        f"{region.path}: tensor {region.name!r}: file ends before its data "
                        "(truncated file); fetch the file again"
                    )
                done += n
    finally:
        view.release()
    return _view(buffer, 0, region)
