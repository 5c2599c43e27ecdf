"""A table's rows read on the host: one step's rows gathered from read-only file mappings.

An engine that keeps a table larger than memory on disk reads each step's
rows from the page cache (engramd's disk-backed set, or the checkpoint's own
files) instead of allocating the table. This module is that read: no table is
allocated, the mappings are never written (PROT_READ), and a worker's private
memory for the table is the step's rows.

API:

    rows = HostRows.of_tensor(tables[name], first_row=start)  # a lease's mapping
    rows = HostRows.of_file(path_or_fd, offset, count, row_bytes)   # a file's rows
    rows = HostRows.of_entry(entry)    # a checkpoint table (TensorEntry.parts: several files)
    reader = RowReader(rows, start, stop)       # this rank's rows [start, stop)
    out = reader.gather(ids)                    # [len(ids), row_bytes] uint8 on the CPU
    reader.gather(ids, out=staging)             # into any CPU tensor of len(ids) rows
                                                # of row_bytes bytes (pinned staging)
    reader.fault_in(ids)                        # only bring the rows into the page cache
    reader.close()                              # drops the staging buffer

`gather` writes row `ids[i]` of the table to `out[i]` when `start <= ids[i] <
stop` and the table has that row, and zeros otherwise: another rank's rows,
and padding rows past the table's end (an ETP reduce that sums raw bytes
stays exact, one owner per row). `ids` is any integer CPU tensor, flattened.
`RowReader.staging(n)` is a reusable buffer of n rows (pinned where CUDA is
available and `pin`), so a step allocates nothing.

How it reads, chosen by measuring each way (tools/rowread_choices.py; the
figures are in docs/engines.md and docs/performance.md):

- warm (the rows' pages in the page cache): one `index_select` over a
  tensor viewing the mapping, the gather a resident table takes. When every
  id falls in the rank's rows (a rank that holds the whole table, or ids
  `aminmax` finds inside its range) no mask is built: `index_select`'s own
  bounds check sends a step with an id outside the table to the masked way.
  Before it, `mincore` of one of the step's pages (SAMPLE_PAGES, a few
  microseconds) routes a step whose pages are not resident to the cold
  way before it faults them in one at a time; a step the sample missed is
  caught by its major faults (getrusage) and the next steps read cold;
- cold: the step's rows are coalesced into runs of neighbouring pages,
  `mincore` finds the runs not resident, `madvise(MADV_WILLNEED)` starts
  their reads at once (many reads in flight, one request per run, exactly
  the step's pages), and the gather is split over `threads` threads, each
  waiting on its own faults (one pool of threads in the process, shared by
  every reader). Steps read cold until one finds all its pages resident.
  Every mapping is `MADV_RANDOM`: a fault reads its own page, not
  a readahead window of rows no step asked for.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import resource
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engramd_shared.errors import CheckpointError
from engramd_shared.headers import DTYPES, TensorEntry

PAGE = mmap.PAGESIZE
_PAGE_MASK = ~(PAGE - 1)
#: Pages between two of a step's rows read as one run (fewer, larger reads).
RUN_GAP_PAGES = 4
#: Threads a cold gather is split over: reads in flight, not cores.
DEFAULT_THREADS = 16
#: A cold gather gives each thread at least this many rows.
_MIN_ROWS_PER_THREAD = 64
#: Pages of a step a warm gather checks with mincore first: one not resident reads it cold
#: (each costs a warm step about 3 us: a cold page cache misses them all, a partly cold one
#: is caught after the step by its major faults).
SAMPLE_PAGES = 1

_MADV_RANDOM = 1
_MADV_WILLNEED = 3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


@dataclass(frozen=True)
class Piece:
    """Rows [first, first + rows.shape[0]) of a table, viewed in one read-only mapping."""

    #: [rows, row_bytes] uint8 over the mapping.
    rows: torch.Tensor
    first: int
    #: What keeps the mapping alive (the mmap, or the tensor the view was taken from).
    owner: object = None


class HostRows:
    """A table's rows over read-only mappings: one piece (a daemon's file) or several
    (a checkpoint table whose row shards are in several files), back to back."""

    def __init__(self, pieces: Sequence[Piece], row_bytes: int) -> None:
        if not pieces:
            raise ValueError("a table's rows need at least one piece")
        at = pieces[0].first
        for p in pieces:
            if p.first != at or p.rows.dim() != 2 or p.rows.shape[1] != row_bytes:
                raise ValueError(
                    f"pieces of rows must follow each other with rows of {row_bytes} bytes: "
                    f"a piece at row {p.first} of shape {tuple(p.rows.shape)} follows row {at}"
                )
            at += p.rows.shape[0]
        self.pieces = tuple(pieces)
        #: Bytes of one row.
        self.row_bytes = row_bytes
        #: The first table row the pieces hold, and the end of their rows.
        self.first = pieces[0].first
        self.end = at
        for p in self.pieces:
            _advise(p.rows, _MADV_RANDOM)

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, first_row: int = 0) -> HostRows:
        """Rows of a CPU tensor over a mapping (an attached table, `Tables[name]`): its row 0
        is table row `first_row` (the start of the rows it was attached with)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dim() < 1:
            raise ValueError("HostRows.of_tensor takes a contiguous CPU tensor of rows")
        rows = tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
        return cls([Piece(rows, first_row, tensor)], rows.shape[1])

    @classmethod
    def of_file(
        cls, file: str | os.PathLike[str] | int, offset: int, count: int, row_bytes: int
    ) -> HostRows:
        """`count` rows of `row_bytes` bytes at byte `offset` of a file (a path, or a
        descriptor this call does not close), mapped read-only."""
        return cls([_map_rows(file, offset, count, row_bytes, 0)], row_bytes)

    @classmethod
    def of_entry(cls, entry: TensorEntry) -> HostRows:
        """A checkpoint table's rows in its own files: each row shard (`entry.parts`) mapped
        read-only where it lies."""
        row_bytes = _row_bytes(entry)
        pieces, first = [], 0
        for span in entry.spans:
            count = span.shape[0] if span.shape else 0
            if count * row_bytes != span.nbytes:
                raise CheckpointError(
                    f"{span.file}: {span.name} holds {span.nbytes} bytes, not {count} rows of "
                    f"{row_bytes}: fetch the checkpoint again"
                )
            pieces.append(_map_rows(span.file, span.offset, count, row_bytes, first))
            first += count
        return cls(pieces, row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows the pieces view."""
        return (self.end - self.first) * self.row_bytes


class RowReader:
    """Gathers the rows of this rank's range [start, stop) for a step's ids; zeros elsewhere."""

    def __init__(
        self,
        rows: HostRows,
        start: int,
        stop: int,
        *,
        threads: int = DEFAULT_THREADS,
        pin: bool = False,
    ) -> None:
        if not 0 <= start <= stop:
            raise ValueError(f"rows [{start}, {stop}) is not a range of rows")
        self.rows = rows
        self.start, self.stop = start, stop
        #: Threads a cold gather is split over.
        self.threads = max(1, threads)
        self.pin = pin
        #: Whether the next gather reads as if the rows were not in the page cache.
        self.cold = False
        #: Pages a cold gather found not resident, summed over this reader's life.
        self.pages_missed = 0
        self._staging: torch.Tensor | None = None
        # Held rows: this range, cut to what the pieces hold (the rest reads as zeros).
        self._lo = max(start, rows.first)
        self._hi = min(stop, rows.end)
        #: Whether the rank holds every row of the pieces: any id index_select accepts.
        self._holds_all = self._lo == rows.first and self._hi == rows.end
        #: Whether the last warm step's ids all fell in the held rows (worth an aminmax).
        self._last_all_held = True
        self._firsts = [p.first for p in rows.pieces]
        self._bases = [p.rows.data_ptr() for p in rows.pieces]
        self._vector = (ctypes.c_ubyte * 1)()

    def staging(self, n: int) -> torch.Tensor:
        """A buffer of `n` rows, reused by later calls (pinned with `pin` and CUDA)."""
        buffer = self._staging
        if buffer is None or buffer.shape[0] < n:
            pin = self.pin and torch.cuda.is_available()
            buffer = torch.empty(
                max(n, 2 * (buffer.shape[0] if buffer is not None else 0)),
                self.rows.row_bytes,
                dtype=torch.uint8,
                pin_memory=pin,
            )
            self._staging = buffer
        return buffer[:n]

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of `ids` (zeros for rows not held here), in `out` or a new tensor.

        `out`: a CPU tensor of len(ids) rows of `row_bytes` bytes each, of any dtype.
        Returns `out` (or the new [len(ids), row_bytes] uint8 tensor).
        """
        flat = ids.reshape(-1)
        if flat.device.type != "cpu":
            raise ValueError("RowReader.gather takes the ids on the CPU")
        n = flat.numel()
        if out is None:
            out = torch.empty(n, self.rows.row_bytes, dtype=torch.uint8)
        if out.dtype == torch.uint8 and out.dim() == 2:
            target = out
        else:
            target = out.view(torch.uint8).reshape(out.shape[0] if out.dim() else 0, -1)
        if target.shape != (n, self.rows.row_bytes) or out.device.type != "cpu":
            raise ValueError(
                f"out must be a CPU tensor of {n} rows of {self.rows.row_bytes} bytes, not "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if n == 0:
            return out
        if flat.dtype != torch.long:
            flat = flat.long()
        if not self.cold and self._sample_missing(flat):
            self.cold = True
        if self.cold:
            held = self._held(flat)
            self.cold = self._hint(flat[held]) > 0
            self._gather(flat, held, target, self.threads)
            return out
        faults = _major_faults()
        if not self._gather_all_held(flat, target):
            self._last_all_held = self._gather(flat, self._held(flat), target, 1)
        self.cold = _major_faults() > faults
        return out

    def fault_in(self, ids: torch.Tensor) -> int:
        """Bring the pages of the held rows of `ids` into the page cache and this process's
        page tables (a device reading the mapping through the host's page tables then
        finds them), on the reader's threads; returns the pages that were not resident."""
        flat = ids.reshape(-1).long()
        flat = flat[(flat >= self._lo) & (flat < self._hi)]
        missing = self._hint(flat)
        if missing:
            # A gather into scratch faults every row's pages in, on the threads.
            scratch = torch.empty(flat.numel(), self.rows.row_bytes, dtype=torch.uint8)
            self._gather(flat, torch.ones_like(flat, dtype=torch.bool), scratch, self.threads)
        return missing

    def close(self) -> None:
        """Drop the staging buffer (the mappings go with `rows`)."""
        self._staging = None

    def _held(self, flat: torch.Tensor) -> torch.Tensor:
        return (flat >= self._lo) & (flat < self._hi)

    def _gather_all_held(self, flat: torch.Tensor, out: torch.Tensor) -> bool:
        """The warm step with no mask, on this thread, where every id is a held row of one
        piece; False (nothing promised of `out`) where one is not."""
        if len(self.rows.pieces) != 1:
            return False
        piece = self.rows.pieces[0]
        local = flat - piece.first if piece.first else flat
        if self._holds_all:
            # index_select checks every id against the piece's rows as it reads them.
            try:
                torch.index_select(piece.rows, 0, local, out=out)
            except IndexError:
                return False
            return True
        if not self._last_all_held:
            return False
        least, most = (int(x) for x in torch.aminmax(flat))
        if least < self._lo or most >= self._hi:
            return False
        torch.index_select(piece.rows, 0, local, out=out)
        return True

    def _sample_missing(self, flat: torch.Tensor) -> bool:
        """Whether one of SAMPLE_PAGES of the step's held rows, spread over the step, lies
        on a page mincore finds not resident."""
        vector, row_bytes, firsts, bases = (
            self._vector,
            self.rows.row_bytes,
            self._firsts,
            self._bases,
        )
        one = len(bases) == 1
        for row in flat[:: -(-flat.numel() // SAMPLE_PAGES)].tolist():
            if not self._lo <= row < self._hi:
                continue
            k = 0 if one else bisect.bisect_right(firsts, row) - 1
            address = bases[k] + (row - firsts[k]) * row_bytes
            if _libc.mincore(address & _PAGE_MASK, 1, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed on a table's mapping")
            if not vector[0] & 1:
                return True
        return False

    def _gather(
        self, flat: torch.Tensor, held: torch.Tensor, out: torch.Tensor, threads: int
    ) -> bool:
        """The held ids' rows into `out`, zeros for the rest; whether every id was held."""
        pieces = self.rows.pieces
        all_held = bool(held.all())
        if len(pieces) == 1:
            local = torch.where(held, flat - pieces[0].first, 0)
            self._index_select(pieces[0].rows, local, out, threads)
            if not all_held:
                # A product with the mask, not masked_fill: a broadcast fill is 15x slower.
                out.mul_(held.unsqueeze(1))
            return all_held
        # Several files: each piece's rows where they go, the rest zero.
        out.zero_()
        firsts = torch.tensor([p.first for p in pieces[1:]], dtype=torch.long)
        which = torch.bucketize(flat, firsts, right=True)
        for i, piece in enumerate(pieces):
            mine = held & (which == i)
            if not bool(mine.any()):
                continue
            where = mine.nonzero().squeeze(1)
            rows = torch.empty(where.numel(), self.rows.row_bytes, dtype=torch.uint8)
            self._index_select(piece.rows, flat[where] - piece.first, rows, threads)
            out.index_copy_(0, where, rows)
        return all_held

    def _index_select(
        self, rows: torch.Tensor, local: torch.Tensor, out: torch.Tensor, threads: int
    ) -> None:
        n = local.numel()
        parts = min(threads, max(1, n // _MIN_ROWS_PER_THREAD))
        if parts <= 1:
            torch.index_select(rows, 0, local, out=out)
            return
        bounds = [n * k // parts for k in range(parts + 1)]

        def one(k: int) -> None:
            a, b = bounds[k], bounds[k + 1]
            torch.index_select(rows, 0, local[a:b], out=out[a:b])

        list(_threads(threads).map(one, range(parts)))

    def _hint(self, flat: torch.Tensor) -> int:
        """Start the reads of the runs of the step's pages that are not resident; the count
        of pages that were not."""
        missing = 0
        for piece in self.rows.pieces:
            count = piece.rows.shape[0]
            local = flat - piece.first
            local = local[(local >= 0) & (local < count)]
            if local.numel() == 0:
                continue
            missing += _willneed(piece.rows, local, self.rows.row_bytes)
        self.pages_missed += missing
        return missing


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _threads(at_least: int) -> ThreadPoolExecutor:
    """The process's one pool of reading threads (every reader's, every layer's), grown to
    `at_least` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < at_least:
            old, _pool = _pool, ThreadPoolExecutor(at_least, thread_name_prefix="engramd-rows")
            _pool_size = at_least
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _runs(pages: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted unique page numbers as [first, last] runs, neighbours within RUN_GAP_PAGES
    joined."""
    if pages.numel() == 1:
        p = int(pages[0])
        return [(p, p)]
    breaks = (pages[1:] - pages[:-1]) > RUN_GAP_PAGES
    firsts = torch.cat([pages[:1], pages[1:][breaks]])
    lasts = torch.cat([pages[:-1][breaks], pages[-1:]])
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def _willneed(rows: torch.Tensor, local: torch.Tensor, row_bytes: int) -> int:
    """madvise(WILLNEED) each run of the rows' pages that mincore finds not all resident."""
    base = rows.data_ptr()
    first_byte = base + local * row_bytes
    pages = torch.unique(torch.cat([first_byte // PAGE, (first_byte + row_bytes - 1) // PAGE]))
    vector = (ctypes.c_ubyte * 0)()
    missing = 0
    for first, last in _runs(pages):
        length = (last - first + 1) * PAGE
        if len(vector) < last - first + 1:
            vector = (ctypes.c_ubyte * (last - first + 1))()
        if _libc.mincore(first * PAGE, length, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed on a table's mapping")
        absent = sum(1 for b in vector[: last - first + 1] if not b & 1)
        if absent:
            missing += absent
            _libc.madvise(first * PAGE, length, _MADV_WILLNEED)
    return missing


def _advise(rows: torch.Tensor, advice: int) -> None:
    """madvise the whole pages a tensor's bytes lie in (best effort: a hint)."""
    nbytes = rows.numel() * rows.element_size()
    if nbytes == 0:
        return
    start = rows.data_ptr() // PAGE * PAGE
    end = -(-(rows.data_ptr() + nbytes) // PAGE) * PAGE
    _libc.madvise(start, end - start, advice)


def _row_bytes(entry: TensorEntry) -> int:
    n = DTYPES[entry.dtype][0]
    for d in entry.shape[1:]:
        n *= d
    return n


def _map_rows(
    file: str | os.PathLike[str] | int, offset: int, count: int, row_bytes: int, first: int
) -> Piece:
    """A read-only shared mapping of `count` rows at byte `offset` of a file."""
    length = count * row_bytes
    fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if offset + length > size:
            raise CheckpointError(
                f"{file}: {count} rows of {row_bytes} bytes at byte {offset} run past the "
                f"file's {size} bytes (a truncated file): fetch it again"
            )
        if length == 0:
            return Piece(torch.empty(0, row_bytes, dtype=torch.uint8), first)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        buffer = mmap.mmap(
            fd, offset + length - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start
        )
    finally:
        if not isinstance(file, int):
            os.close(fd)
    with warnings.catch_warnings():
        # torch warns it cannot protect a read-only buffer: the mapping is PROT_READ.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=length, offset=offset - start)
    return Piece(flat.view(count, row_bytes), first, buffer)
