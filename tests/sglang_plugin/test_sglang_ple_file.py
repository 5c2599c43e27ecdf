"""The plugin's `file` backend helpers on rows that do not fill pages: SGLang 0.5.23's own
PleFileRssTrimmer over a served table's file pages, and the prefetcher that advises them.

A table of 160-byte rows (Qwen3.8-Flash-Next's row size), held on a daemon's disk
backing, attached over a rank's range that starts inside a page and runs past the
table's end: the mapping is file pages from the page that holds the first row, the
bytes of the last partial page copied, then zero rows (engramd_client.mapping).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engramd.host.pagecache import resident_bytes
from engramd_client.engines.sglang import ple_file, qwen4exp
from engramd_client.share import attach
from engramd_shared.layout import tensor_file_name
from helpers import wait_until

ROWS, WIDTH = 100_000, 80  # bf16: 160-byte rows, 16 MB
#: This rank's rows: from inside a page, past the table's end (the last rank's padding).
START, STOP = 33_333, 102_400
PAGE = 4096


@pytest.fixture
def table(tmp_path: Path, daemons: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(ROWS, WIDTH, generator=g).to(torch.bfloat16)
    save_file({"ple.weight": rows}, str(folder / "model.safetensors"))
    disk = tmp_path / "tables"
    disk.mkdir()
    d = daemons(
        "--backing", "disk", "--disk-dir", str(disk), "--tensors", "ple.weight",
        "--checkpoint", str(folder),
    )  # fmt: skip
    held = []

    def rank(start: int, stop: int) -> torch.Tensor:
        """A rank's table of rows [start, stop), as the plugin serves it."""
        tables = attach(
            folder,
            tensors="ple.weight",
            rows={"ple.weight": (start, stop)},
            share=True,
            socket=str(d.socket),
            pad_rows=True,
        )
        held.append(tables)
        served = tables["ple.weight"]
        setattr(served, qwen4exp.SERVED_MARK, True)
        return served

    served = rank(START, STOP)
    [file] = disk.rglob(tensor_file_name(0))
    monkeypatch.setenv("SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB", "0.0001")
    yield served, rows, file, rank
    for tables in held:
        tables.close()


def _expected(rows: torch.Tensor) -> torch.Tensor:
    padding = torch.zeros(STOP - ROWS, WIDTH, dtype=torch.bfloat16)
    return torch.cat([rows[START:], padding])


def test_the_trimmer_drops_only_file_pages_and_every_row_reads_back(table: Any) -> None:
    served, rows, _, _ = table
    span = ple_file.file_span(served)
    assert span is not None
    address, nbytes = span
    assert address % PAGE == 0 and address <= served.data_ptr()
    # The file pages end at the last whole page of the table's rows: the partial page
    # after them is a private copy (MADV_DONTNEED would zero it), then the padding.
    held_end = served.data_ptr() + (ROWS - START) * WIDTH * 2
    assert address + nbytes == held_end - held_end % PAGE
    trimmer = qwen4exp._trimmer(served)
    assert type(trimmer).__name__ == "PleFileRssTrimmer"
    try:
        assert torch.equal(served.view(torch.uint8), _expected(rows).view(torch.uint8))
        assert trimmer.trim_once() > 0  # SGLang's own trim, over the span
        assert trimmer.mapping_rss_bytes() < nbytes / 10
        # The rows come back from the page cache, the copied page and the zeros untouched.
        assert torch.equal(served.view(torch.uint8), _expected(rows).view(torch.uint8))
    finally:
        trimmer.close()


def test_the_prefetcher_reads_the_pages_of_the_rows_sglang_names(table: Any) -> None:
    served, _, file, _ = table
    trimmer = qwen4exp._trimmer(served)
    trimmer.trim_once()  # no page of the file mapped here, so it can be evicted
    trimmer.close()
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert resident_bytes(fd, 0, os.fstat(fd).st_size) < os.fstat(fd).st_size / 10
        prefetcher = qwen4exp._prefetcher(served)
        assert isinstance(prefetcher, ple_file.MappedPrefetcher)
        # A prefill's gather: global ids, every 29th row of this rank's, 2048 of them.
        ids = START + torch.arange(2048) * 29
        assert prefetcher.enqueue(ids, vocab_start=START, vocab_end=ROWS)
        prefetcher.close()
        offsets = [(int(i) * WIDTH * 2, (int(i) + 1) * WIDTH * 2) for i in ids]

        wait_until(
            lambda: all(resident_bytes(fd, lo, hi - lo) == hi - lo for lo, hi in offsets),
            30,
            "the prefetched rows' pages in the page cache",
        )
    finally:
        os.close(fd)


def test_a_rank_of_padding_rows_only_gets_no_trimmer(table: Any) -> None:
    """The last rank of a padded vocabulary may hold no row of the checkpoint: its table is
    zeros of its own, with no file page for SGLang's trimmer to drop."""
    _, _, _, rank = table
    padding = rank(ROWS + 64, ROWS + 2048)
    assert ple_file.file_span(padding) is None
    assert qwen4exp._trimmer(padding) is None
    assert not padding.view(torch.uint8).any()
