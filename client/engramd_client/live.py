"""Live tables: one address per tensor for the worker's life, its backing replaced in place.

Engines capture a table's address (CUDA graphs take `data_ptr()` as a kernel
argument; vLLM keeps a UVA view of it), so a table may not move while an
engine runs; only the pages behind it may. A `LiveAddress` reserves a range
of addresses (PROT_NONE, no memory) for one tensor and maps a `Backing`
into it: descriptors' pages mapped MAP_SHARED | MAP_FIXED at fixed places,
then pages of the worker's own (a partial last page copied, padding rows
zero). `apply` maps another backing over the same range: each mmap with
MAP_FIXED replaces the pages under its addresses in one call, and frees what
was there once nothing else holds it (a private memfd whose descriptor the
old backing closes).

Backings:

- `file_backing`: a region of a descriptor the daemon handed out (tmpfs,
  hugetlbfs, memfd: engramd_client.handles), read-only;
- `private_backing`: the worker's own copy in a memfd, read from the
  checkpoint (writable, so a GPU can register it as a private copy);
- a later generation of a set is a `file_backing` of its new descriptors.

An address is chosen so that the daemon's pages can be mapped there later:
the tensor starts at `delta` bytes past a RESERVE_ALIGN boundary, `delta`
the tensor's first byte's offset in its file modulo that alignment (a
private copy takes the offset the daemon's file will have: the tensor's
lead, engramd_shared.layout), so the file's pages, huge ones included, fall
on their own boundaries. A backing
whose pages cannot fall there (`misfit`) is refused before anything moves.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass, field

import torch

from engramd_client.mapping import Region, _libc, _on_hugetlbfs, _read_into, _view
from engramd_shared.headers import TensorEntry

#: Where a tensor's range starts: a 2 MiB boundary, a huge page of tmpfs and of hugetlbfs'
#: default size. A backing on larger pages fits only a range aligned to them.
RESERVE_ALIGN = 2 << 20
_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_MFD_CLOEXEC = 0x1
_PROT_NONE = 0


@dataclass(frozen=True)
class Piece:
    """`length` bytes of descriptor `fd` from `file_offset`, mapped `at` bytes into a range."""

    at: int
    length: int
    fd: int
    file_offset: int
    #: The descriptor's page: its mapping starts on one, at a file offset of whole ones.
    page: int


@dataclass
class Backing:
    """What backs one tensor's range: descriptors' pieces, then bytes of the worker's own."""

    #: Shared pieces, in order of address.
    pieces: list[Piece]
    #: Bytes of the worker's own (a copied partial page) at `own_at` bytes into the range,
    #: the end of the pieces (or, with none, the page the region starts in); zero pages
    #: around them to the range's end.
    own: bytes = b""
    own_at: int = 0
    #: Mapped PROT_READ | PROT_WRITE (a private copy, or a writable GPU route); else PROT_READ.
    writable: bool = False
    #: What it is, for the log lines: "private", "shared".
    kind: str = "shared"
    #: Fill the page tables when mapped (MAP_POPULATE): attach(populate=True).
    populate: bool = False
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Close the descriptors: its pages go once no mapping holds them (a memfd's at once)."""
        if self._closed:
            return
        self._closed = True
        for fd in {p.fd for p in self.pieces}:
            os.close(fd)


class LiveAddress:
    """A range of addresses, reserved for one tensor's life, that a backing is mapped into."""

    def __init__(self, nbytes: int, delta: int, align: int = RESERVE_ALIGN) -> None:
        if not 0 <= delta < align:
            raise ValueError(f"delta {delta} is outside an alignment of {align}")
        #: Bytes of the tensor (rows and padding rows).
        self.nbytes = nbytes
        #: The tensor starts `delta` bytes into the range.
        self.delta = delta
        self.align = align
        # Whole alignments: a backing's last (huge) page never reaches past the range.
        self.size = -(-(delta + nbytes) // align) * align
        reserve = self.size + align
        raw = _libc.mmap(
            None,
            reserve,
            _PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            -1,
            0,
        )
        if raw in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"cannot reserve {reserve} bytes of addresses")
        #: The range's first byte, on an `align` boundary.
        self.start = -(-raw // align) * align
        # The whole reservation goes when the tensor's last view is collected.
        self._array = (ctypes.c_ubyte * max(nbytes, 1)).from_address(self.start + delta)
        weakref.finalize(self._array, _libc.munmap, raw, reserve)

    @property
    def address(self) -> int:
        """The tensor's first byte: the same for every backing."""
        return self.start + self.delta

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over the range (keeps the reservation while it lives)."""
        region = Region("", "U8", (self.nbytes,), "", 0, self.nbytes)
        flat = _view(self._array, 0, region)
        return flat.view(dtype).view(shape)

    def misfit(self, backing: Backing) -> str | None:
        """Why `backing` cannot be mapped into this range, or None when it can."""
        for piece in backing.pieces:
            address = self.start + piece.at
            end = -(-(piece.at + piece.length) // piece.page) * piece.page
            if piece.at < 0 or end > self.size:
                return f"its pages run outside the tensor's range ({piece.at}+{piece.length})"
            if address % piece.page or piece.file_offset % piece.page:
                return (
                    f"its pages of {piece.page} bytes would start at {address:#x} (file offset "
                    f"{piece.file_offset}), not on a page of their size"
                )
        return None

    def apply(self, backing: Backing) -> None:
        """Map `backing` over the range, each piece in one mmap with MAP_FIXED.

        The caller holds the step boundary: nothing reads the range meanwhile.
        """
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if backing.writable else 0)
        end = 0
        for piece in backing.pieces:
            at = self.start + piece.at
            flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if backing.populate else 0)
            mapped = _libc.mmap(at, piece.length, prot, flags, piece.fd, piece.file_offset)
            if mapped != at:
                raise OSError(ctypes.get_errno(), f"cannot map {piece.length} bytes at {at:#x}")
            end = -(-(piece.at + piece.length) // piece.page) * piece.page
        if end < self.size:
            # Fresh zero pages of the worker's own for the rest; what was there goes.
            at = self.start + end
            rest = self.size - end
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
            writable = mmap.PROT_READ | mmap.PROT_WRITE
            if _libc.mmap(at, rest, writable, flags, -1, 0) != at:
                raise OSError(ctypes.get_errno(), f"cannot map {rest} bytes at {at:#x}")
            if backing.own:
                ctypes.memmove(self.start + backing.own_at, backing.own, len(backing.own))
            if prot != writable and _libc.mprotect(at, rest, prot) != 0:
                raise OSError(ctypes.get_errno(), f"cannot protect {rest} bytes at {at:#x}")


def delta_for(offset: int, align: int = RESERVE_ALIGN) -> int:
    """Where a tensor whose first byte is at `offset` of its file starts in its range."""
    return offset % align


def file_backing(fd: int, region: Region, live: LiveAddress, writable: bool = False) -> Backing:
    """A region of a read-only descriptor (`fd`, now the backing's) as the backing of `live`.

    Whole pages of the file are shared; where padding rows follow the
    region, its last partial page is copied (what follows the region in the
    file never shows as padding) and the padding is zeros.
    """
    try:
        st = os.fstat(fd)
        if region.offset + region.length > st.st_size:
            raise OSError(
                f"{region.path} is {st.st_size} bytes, the handle needs "
                f"{region.offset + region.length}"
            )
        hugetlb = _on_hugetlbfs(fd)
        page = max(_PAGE, st.st_blksize) if hugetlb else _PAGE
        lead = region.offset % page
        at = live.delta - lead
        length = lead + region.length
        own, own_at = b"", 0
        if region.pad:
            shared = length // page * page
            tail = length - shared
            if tail:
                own = os.pread(fd, tail, region.offset - lead + shared)
                if len(own) != tail:
                    raise OSError(f"{region.path} ended before its last rows")
                own_at = at + shared
            length = shared
        else:
            length = -(-length // page) * page
        pieces = [Piece(at, length, fd, region.offset - lead, page)] if length else []
        return Backing(pieces, own=own, own_at=own_at, writable=writable, kind="shared")
    except BaseException:
        os.close(fd)
        raise


def private_backing(entry: TensorEntry, region: Region, live: LiveAddress) -> Backing:
    """The worker's own copy of `region` of checkpoint tensor `entry`, in a memfd, as the
    backing of `live` (its page offsets as `live` places them).

    A memfd rather than anonymous memory: the move to another backing keeps
    it whole until every range has moved, then closing it frees its pages.
    """
    lead = live.delta % _PAGE
    size = -(-(lead + region.length) // _PAGE) * _PAGE
    if region.length == 0:
        return Backing([], writable=True, kind="private")
    fd = os.memfd_create(f"engramd-private:{entry.name}"[:249], _MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        view = memoryview(buffer)
        try:
            at = 0
            for span in entry.spans:
                begin = max(region.offset, at)
                end = min(region.offset + region.length, at + span.nbytes)
                if begin < end:
                    start = lead + begin - region.offset
                    _read_into(view[start : start + end - begin], span, begin - at)
                at += span.nbytes
        finally:
            view.release()
            buffer.close()
    except BaseException:
        os.close(fd)
        raise
    return Backing([Piece(live.delta - lead, size, fd, 0, _PAGE)], writable=True, kind="private")
