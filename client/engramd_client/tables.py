"""Tensors over memory: read-only mappings of the daemon's files, or private copies.

Both paths hand out CPU tensors that view their memory without a copy. A
shared tensor views a PROT_READ mapping: a write through it faults (SIGSEGV)
instead of changing the table for every worker. A private tensor views a
private anonymous mapping of exactly the tensor's bytes (rounded to a page),
filled with positional reads from the checkpoint; no caching allocator rounds
it up. Like the engines' private tables it is the process's own memory (not
Shmem), on transparent huge pages where the kernel gives them (`use_thp`).
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from engramd_client.core.checkpoint import DTYPES, TablePlan, TensorEntry
from engramd_client.core.errors import CheckpointError, NoCpuView

if TYPE_CHECKING:
    from engramd_client.lease import Lease

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


class Tables(Mapping[str, torch.Tensor]):
    """The tensors of a table set, by name; shared (read-only mappings) or private.

    Use as a mapping (`tables[name]`, `list(tables)`) and close it, or use it as
    a context manager. Closing ends the lease; the memory goes when the last
    tensor taken from it is garbage collected.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        mode: str,
        set_id: str,
        reason: str | None = None,
        lease: Lease | None = None,
    ) -> None:
        self._tensors = tensors
        self._lease = lease
        #: "shared" or "private".
        self.mode = mode
        #: Why the tables are private (the warning's text), or None.
        self.reason = reason
        #: The set id of these tables.
        self.set_id = set_id
        #: How `attach` made these tables: `refresh` calls it again.
        self.reattach: Callable[[], Tables] | None = None
        self._when_closed: list[Callable[[], None]] = []
        self._names = list(tensors)
        self._views: dict[str, torch.Tensor] = {}
        #: The CUDA device of the tables' CUDA views (`cuda`), or None.
        self.device: torch.device | None = None
        #: How the device reads the tables (engramd_client.cuda.ROUTES), "" without one.
        self.gpu_route = ""

    @classmethod
    def private(
        cls, plan: TablePlan, rows: RowRanges | None, reason: str | None, thp: bool = True
    ) -> Tables:
        """Private copies of a plan's tensors, read from the checkpoint (on THP with `thp`)."""
        check_row_names(rows, [t.name for t in plan.tensors])
        tensors = {t.name: load_private(t, rows, thp) for t in plan.tensors}
        return cls(tensors, mode="private", set_id=plan.set_id, reason=reason)

    @property
    def lease_id(self) -> str | None:
        """The daemon's id of this worker's lease (shared mode), or None."""
        return self._lease.lease_id if self._lease else None

    @property
    def stale(self) -> bool:
        """The daemon holds a newer copy of the set than this one (dropped and loaded again)."""
        return self._lease is not None and self._lease.stale

    def refresh(self) -> Tables:
        """Attach again, as `attach` did for these tables; close these once the new ones are bound.

        Mappings are never swapped under live tensors: the model binds the
        tensors of the returned Tables (a stale worker moves to the new copy).
        """
        if self.reattach is None:
            raise ValueError("these tables were not made by attach(); attach again instead")
        return self.reattach()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors handed out (row ranges only, when given)."""
        tensors = self._tensors or self._views
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors and name in self._views:
            raise NoCpuView(
                f"{name!r} of set {self.set_id} lives in GPU memory (engramd's cuda-device "
                f"backing): use tables.cuda({name!r}), its CUDA view"
            )
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def register_on(self, index: int, route: str) -> None:
        """Make every tensor readable on CUDA device `index` in place, by `route` (attach(device=)).

        `route` is one of engramd_client.cuda.ROUTES other than cumem-import.
        """
        from engramd_client.cuda import register_all

        registrations = register_all(self._tensors, index, route)
        self.gpu_route = route

        def release() -> None:
            for registration in registrations.values():
                registration.release()

        self.set_views({n: r.view for n, r in registrations.items()}, index, release)

    def set_views(
        self, views: dict[str, torch.Tensor], index: int, release: Callable[[], None]
    ) -> None:
        """Give the tables CUDA views on device `index`; `close()` calls `release` for them."""
        if self.device is not None:
            raise ValueError(f"these tables have CUDA views on {self.device} already")
        self._views = views
        self._names = self._names or list(views)
        self.device = torch.device("cuda", index)
        self.when_closed(release)

    def cuda(self, name: str) -> torch.Tensor:
        """The tensor `name` on the CUDA device, read in place (no copy): host pages over UVA,
        or the GPU's own memory for a set of engramd's cuda-device backing.

        Valid until `close()`, which unregisters or unmaps the memory.
        """
        if self.device is None:
            raise ValueError(
                "these tables have no CUDA views: attach with device='cuda:N' (or ENGRAMD_DEVICE)"
            )
        return self._views[name]

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback` when these tables close, the latest first.

        bind() undoes its bindings there, before the CUDA views they may hold are
        released (set_views registered that first).
        """
        self._when_closed.append(callback)

    def close(self) -> None:
        """Undo bindings, release CUDA views, end the lease (if shared), drop the references."""
        callbacks, self._when_closed = self._when_closed, []
        self._views, self.device = {}, None
        for callback in reversed(callbacks):
            callback()
        if self._lease is not None:
            self._lease.close()
            self._lease = None
        self._tensors, self._names = {}, []

    def __enter__(self) -> Tables:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Tables(mode={self.mode!r}, set_id={self.set_id!r}, tensors={len(self)}, "
            f"nbytes={self.nbytes})"
        )
