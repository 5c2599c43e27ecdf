"""engramd_client.rowread: a step's rows gathered on the host from read-only file mappings."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from engramd.testing.pagecache import evict_file
from engramd.testing.synth import PleSpec, expected_ple_rows, synthesize_ple
from engramd_client import rowread
from engramd_client.rowread import HostRows, RowReader
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import CheckpointError

ROW_BYTES = 96
_libc = ctypes.CDLL(None, use_errno=True)


def _table(path: Path, rows: int, offset: int = 0) -> torch.Tensor:
    """A file of `rows` random rows of ROW_BYTES after `offset` bytes of something else."""
    data = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8)
    path.write_bytes(b"\xff" * offset + data.numpy().tobytes() + b"\xee" * 100)
    return data


def _expected(table: torch.Tensor, ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    rows = torch.zeros(ids.numel(), table.shape[1], dtype=torch.uint8)
    held = (ids >= start) & (ids < min(stop, table.shape[0]))
    rows[held] = table[ids[held]]
    return rows


def _maps_of(address: int) -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    return ""


def _evict(paths: Path | set[Path], rows: HostRows) -> None:
    """The files' pages out of the page cache: written back, dropped from this process's page
    tables (MADV_DONTNEED), then from the cache."""
    for piece in rows.pieces:
        start = piece.rows.data_ptr() // 4096 * 4096
        end = piece.rows.data_ptr() + piece.rows.numel()
        assert _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4) == 0
    for path in {paths} if isinstance(paths, Path) else paths:
        evict_file(path)


def test_a_ranks_rows_and_zeros_for_the_others(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    table = _table(path, 5000, offset=1234)
    rows = HostRows.of_file(path, 1234, 5000, ROW_BYTES)
    reader = RowReader(rows, 1000, 3000)
    ids = torch.cat([torch.randint(0, 5000, (700,)), torch.tensor([0, 999, 1000, 2999, 3000])])
    out = reader.gather(ids.view(-1, 5))
    assert torch.equal(out, _expected(table, ids, 1000, 3000))
    # The mapping is read-only and shared: the file's pages, not a copy.
    line = _maps_of(rows.pieces[0].rows.data_ptr())
    assert line.split()[1] == "r--s" and str(path) in line
    reader.close()


def test_rows_past_the_tables_end_are_zeros_and_out_may_be_any_dtype(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    table = _table(path, 300)
    reader = RowReader(HostRows.of_file(path, 0, 300, ROW_BYTES), 200, 400)
    ids = torch.tensor([199, 200, 299, 300, 399, 400])
    out = torch.full((6, ROW_BYTES // 2), 7, dtype=torch.bfloat16)
    assert reader.gather(ids, out=out) is out
    assert torch.equal(out.view(torch.uint8), _expected(table, ids, 200, 400))
    with pytest.raises(ValueError, match="rows of 96 bytes"):
        reader.gather(ids, out=torch.empty(6, 10, dtype=torch.uint8))


def test_a_lease_tensor_is_read_from_its_first_row(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    table = _table(path, 1000)
    # As attach(rows=) maps rows [400, 700) of a table: row 0 of the tensor is row 400.
    mapped = HostRows.of_file(path, 400 * ROW_BYTES, 300, ROW_BYTES).pieces[0].rows
    reader = RowReader(HostRows.of_tensor(mapped.view(torch.bfloat16), first_row=400), 400, 700)
    ids = torch.arange(0, 1000, 7)
    assert torch.equal(reader.gather(ids), _expected(table, ids, 400, 700))


@pytest.mark.parametrize("fmt", ["F8_E4M3", "NVFP4"])
def test_a_checkpoint_table_read_across_its_shard_files(tmp_path: Path, fmt: str) -> None:
    spec = PleSpec(layers=(0,), rows=1000, dim=64, parts=7, fmt=fmt, files=3)
    synthesize_ple(tmp_path / "ckpt", spec)
    plan = plan_tables(tmp_path / "ckpt", "*ple_embedding*")
    for entry in plan.tensors:
        if len(entry.parts) < 2:
            continue
        part = entry.name.rpartition(".")[2]
        rows = HostRows.of_entry(entry)
        assert len(rows.pieces) == spec.parts and rows.end == 1000
        assert len({p.file for p in entry.parts}) == 3
        # Every shard boundary, each side, and random rows, over two ranks' ranges.
        edges = [p.first for p in rows.pieces[1:]]
        ids = torch.tensor(
            [e + d for e in edges for d in (-1, 0)] + torch.randint(0, 1100, (500,)).tolist()
        )
        for start, stop in ((0, 550), (550, 1100)):
            reader = RowReader(rows, start, stop, threads=4)
            got = reader.gather(ids)
            held = (ids >= start) & (ids < min(stop, 1000))
            assert torch.equal(got[held], expected_ple_rows(spec, 0, part, ids[held]))
            assert not got[~held].any()
            reader.close()


def test_a_cold_step_reads_the_pages_it_missed_and_every_row_is_right(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    table = _table(path, 40000)
    rows = HostRows.of_file(path, 0, 40000, ROW_BYTES)
    reader = RowReader(rows, 0, 40000, threads=8)
    ids = torch.randint(0, 40000, (4000,))
    _evict(path, rows)
    # A warm reader's first cold step is found cold before it gathers (its sampled pages are
    # not resident): it hints the pages it misses and reads on threads.
    assert not reader.cold
    assert torch.equal(reader.gather(ids), table[ids])
    assert reader.pages_missed > 0 and reader.cold
    missed = reader.pages_missed
    _evict(path, rows)
    # A cold step hints the missing runs, reads on threads, and stays cold while it missed.
    assert torch.equal(reader.gather(ids), table[ids])
    assert reader.pages_missed > missed and reader.cold
    # Now every page of these ids is resident: the next cold step finds none missing.
    assert torch.equal(reader.gather(ids), table[ids])
    assert not reader.cold
    # And a warm step stays warm.
    assert torch.equal(reader.gather(ids), table[ids])
    assert not reader.cold
    reader.close()


def test_a_cold_step_of_a_checkpoint_table_is_found_in_any_shard(tmp_path: Path) -> None:
    spec = PleSpec(layers=(0,), rows=4000, dim=256, parts=4, fmt="F8_E4M3", files=2)
    synthesize_ple(tmp_path / "ckpt", spec)
    plan = plan_tables(tmp_path / "ckpt", "*ple_embedding*")
    [entry] = [e for e in plan.tensors if e.name.endswith(".weight")]
    rows = HostRows.of_entry(entry)
    assert len(rows.pieces) == spec.parts
    reader = RowReader(rows, 0, 4000, threads=4)
    # Ids only in the last shard: the sample finds that shard's pages, not the first's.
    ids = torch.randint(3000, 4000, (400,))
    _evict({Path(p.file) for p in entry.parts}, rows)
    assert torch.equal(reader.gather(ids), expected_ple_rows(spec, 0, "weight", ids))
    assert reader.pages_missed > 0
    reader.close()


def test_every_way_of_the_warm_step_gives_the_rows_and_exact_zeros(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A warm step's after-check counts the whole process's major faults: a library page an
    # earlier test evicted, touched during the step, would send the next step cold. Held
    # still here, so the step's own sampled page alone routes it.
    monkeypatch.setattr(rowread, "_major_faults", lambda: 0)
    path = tmp_path / "t.bin"
    table = _table(path, 3000)
    rows = HostRows.of_file(path, 0, 3000, ROW_BYTES)
    inside = torch.randint(0, 3000, (600,))
    # A rank holding the whole table: ids inside, then ids past its end and negative ones
    # (index_select refuses them, the masked way zeros them), then inside again.
    whole = RowReader(rows, 0, 5000)
    for ids in (inside, torch.cat([inside, torch.tensor([-1, 3000, 4999, -7])]), inside):
        assert torch.equal(whole.gather(ids), _expected(table, ids, 0, 5000))
        assert not whole.cold
    # A rank of part of the rows: ids all its own (no mask), then others' (zeros), then
    # its own again.
    part = RowReader(rows, 1000, 2000)
    own = torch.randint(1000, 2000, (600,))
    for ids in (own, inside, own, inside):
        out = torch.full((ids.numel(), ROW_BYTES), 0xAB, dtype=torch.uint8)
        assert torch.equal(part.gather(ids, out=out), _expected(table, ids, 1000, 2000))
    # A lease's tensor whose row 0 is table row 1000, all ids its own.
    lease = RowReader(
        HostRows.of_tensor(rows.pieces[0].rows[1000:2000], first_row=1000), 1000, 2000
    )
    assert torch.equal(lease.gather(own), table[own])


def test_fault_in_brings_the_rows_pages_in(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    _table(path, 20000)
    rows = HostRows.of_file(path, 0, 20000, ROW_BYTES)
    reader = RowReader(rows, 0, 20000, threads=4)
    ids = torch.randint(0, 20000, (500,))
    _evict(path, rows)
    assert reader.fault_in(ids) > 0
    assert reader.fault_in(ids) == 0
    reader.close()


def test_the_staging_buffer_is_reused(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    _table(path, 100)
    reader = RowReader(HostRows.of_file(path, 0, 100, ROW_BYTES), 0, 100)
    first = reader.staging(64)
    assert reader.staging(32).data_ptr() == first.data_ptr()
    assert reader.staging(100).shape == (100, ROW_BYTES)


def test_a_short_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    _table(path, 10)
    with pytest.raises(CheckpointError, match="truncated file"):
        HostRows.of_file(path, 0, 20, ROW_BYTES)
