"""SGLang's `file` PLE backend (`--ple-offload-backend file`) served from the daemon's copy.

SGLang's own file backend (sglang/srt/models/qwen4_exp_ple_table.py) maps a
sparse file per TP rank under its table folder and rewrites every row into
it at each start through its loader; its Triton gather reads the mapping
through the host page tables (unified-memory GPUs: GB10). Served, the
rank's table is instead a read-only shared mapping of its rows of the
daemon's copy (a disk-backed set, `--backing disk`, on a machine whose
memory is smaller than the tables), its padding rows zero pages of the
worker's own, never registered with CUDA: SGLang creates, truncates and
writes no table file, and its loader copies no row (weights.py).

What SGLang does around its own mapping is done on this one:

- `MADV_RANDOM` over the table, as SGLang's allocator applies to its own;
- its resident-set trimmer (SGLang's PleFileRssTrimmer: MADV_DONTNEED in
  slices), over the table's file pages only (`file_span`): a rank's rows
  need not start on a page, and the last partial page before the padding
  rows is a private copy, which MADV_DONTNEED would turn to zeros;
- its prefetcher advises offsets of its own per-rank file, counted from the
  rank's first row, which in the daemon's file are elsewhere: the served
  table's prefetcher (`MappedPrefetcher`) advises the same rows' pages
  through the mapping instead (madvise WILLNEED on a file mapping starts
  the readahead posix_fadvise WILLNEED starts).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("engramd_client")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE = mmap.PAGESIZE
#: SGLang's page of a table file (qwen4_exp_ple_table._PAGE_SHIFT): 4 KiB whatever the
#: kernel's page size (64 KiB on some arm64 kernels).
_SGLANG_PAGE = 1 << 12


def madvise(table: torch.Tensor, advice: int) -> bool:
    """madvise(2) over the table's pages (advisory: False where the kernel refused)."""
    address = table.data_ptr()
    start = address - address % mmap.PAGESIZE
    length = address + table.numel() * table.element_size() - start
    return _libc.madvise(start, length, advice) == 0


def advise_random(table: torch.Tensor, source: str) -> None:
    """MADV_RANDOM over the table, as SGLang's file backend advises its own mapping."""
    if not madvise(table, mmap.MADV_RANDOM):
        log.info("madvise(MADV_RANDOM) refused on the PLE table of %s: readahead stays on", source)


def file_span(table: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the file pages the table's mapping holds, whole pages from the
    table's first: its mapping's file-backed range (/proc/self/maps), cut to the table;
    None where it starts in none (a rank of padding rows only, or of less than a page)."""
    address = table.data_ptr()
    end = address + table.numel() * table.element_size()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, inode, *_ = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            if inode == "0":
                return None
            start = address - address % _PAGE
            return start, min(high, end) - start
    return None


class MappedPrefetcher:
    """SGLang's PleFilePrefetcher for a served table: the same pages, advised by address.

    `pages_for_rows` and `min_rows` are SGLang's (its class and
    PLE_FILE_PREFETCH_MIN_ROWS); rows are this rank's, as SGLang's gather passes them.
    """

    def __init__(self, table: torch.Tensor, pages_for_rows: Any, min_rows: int) -> None:
        self._address = table.data_ptr()
        self._row_bytes = int(table.shape[-1]) * table.element_size()
        self._pages_for_rows = pages_for_rows
        self._min_rows = int(min_rows)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engramd-ple-prefetch")

    def enqueue(
        self, flat_ids: torch.Tensor, *, vocab_start: int = 0, vocab_end: int | None = None
    ) -> bool:
        """Queue the WILLNEED hint for a prefill-sized gather's rows; whether any was queued."""
        if flat_ids.numel() < self._min_rows:
            return False
        if flat_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        rows = flat_ids.detach().cpu()
        if vocab_end is not None:
            rows = rows[(rows >= vocab_start) & (rows < vocab_end)]
        rows = rows - vocab_start
        if rows.numel() == 0:
            return False
        self._pool.submit(self._advise, self._pages_for_rows(rows, self._row_bytes))
        return True

    def _advise(self, pages: list[int]) -> None:
        for page in pages:
            # SGLang's page N of its file is bytes [N x 4 KiB, +4 KiB) from the table's
            # first; the table need not start on a page: the pages those bytes touch.
            first = self._address + page * _SGLANG_PAGE
            start = first - first % _PAGE
            length = -(-(first + _SGLANG_PAGE - start) // _PAGE) * _PAGE
            if _libc.madvise(start, length, mmap.MADV_WILLNEED) != 0:
                return

    def close(self) -> None:
        """Stop advising."""
        self._pool.shutdown(wait=False)
