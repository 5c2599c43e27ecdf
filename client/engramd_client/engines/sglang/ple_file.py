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

What SGLang does around the mapping keeps working on it:

- `MADV_RANDOM` over the table, as SGLang's allocator applies to its own;
- its resident-set trimmer (`make_ple_file_rss_trimmer`: MADV_DONTNEED in
  slices over the table's addresses) needs only the table's address and the
  path attribute its factory looks for, which the served table carries;
- its prefetcher (`make_ple_file_prefetcher`) opens the path and advises
  offsets counted from the rank's first row, which in the daemon's file
  are not at offset 0: the served table's prefetcher (`MappedPrefetcher`)
  advises the same pages through the mapping instead (madvise WILLNEED on
  a file mapping starts the same readahead as posix_fadvise WILLNEED).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger("engramd_client")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
#: The attribute SGLang's prefetcher and trimmer factories find a file-backed table by.
PATH_ATTRIBUTE = "_sglang_ple_file_path"


def madvise(table: torch.Tensor, advice: int) -> bool:
    """madvise(2) over the table's pages (advisory: False where the kernel refused)."""
    address = table.data_ptr()
    start = address - address % mmap.PAGESIZE
    length = address + table.numel() * table.element_size() - start
    return _libc.madvise(start, length, advice) == 0


def served_table(table: torch.Tensor, source: str) -> torch.Tensor:
    """The rank's mapped rows as SGLang's file backend hands its own table out: random
    access advised, and marked with where the bytes are (`source`) for SGLang's factories."""
    if not madvise(table, mmap.MADV_RANDOM):
        log.info("madvise(MADV_RANDOM) refused on the PLE table of %s: readahead stays on", source)
    setattr(table, PATH_ATTRIBUTE, source)
    return table


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
        base = self._address
        for page in pages:
            at = base + page * mmap.PAGESIZE
            # The table need not start on a page: advise the pages the rows' bytes touch.
            start = at - at % mmap.PAGESIZE
            if _libc.madvise(start, 2 * mmap.PAGESIZE, mmap.MADV_WILLNEED) != 0:
                return

    def close(self) -> None:
        """Stop advising."""
        self._pool.shutdown(wait=False)
