"""A load and the page cache: a checkpoint not cached is read direct into the set's pages;
one cached is copied out of it, and the bytes it read are dropped behind the reads. Either
way the node keeps one copy of the tables; the rest of the checkpoint's files is left as it
was."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from conftest import mounted_ramfs
from engramd.host.pagecache import resident_bytes
from engramd.testing.synth import PleSpec, synthesize_ple
from engramd.units import parse_size
from engramd_client import plan_tables
from engramd_shared.checkpoint import TablePlan
from engramd_shared.headers import SAMPLES
from engramd_shared.layout import DIRECT_ALIGN, MANIFEST_NAME, Manifest, sets_root

PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident(ranges: list[tuple[Path, int, int]]) -> int:
    total = 0
    for path, offset, nbytes in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            total += resident_bytes(fd, offset, nbytes)
        finally:
            os.close(fd)
    return total


def test_a_load_drops_the_tables_it_read_from_the_page_cache(
    checkpoint: Path, daemons: Any
) -> None:
    plan = plan_tables(checkpoint)
    spans = [(s.file, s.offset, s.nbytes) for t in plan.tensors for s in t.spans]
    # Each file's header, which the daemon reads too, and keeps cached.
    firsts: dict[Path, int] = {}
    for f, offset, _ in spans:
        firsts[f] = min(offset, firsts.get(f, offset))
    heads = [(f, 0, offset) for f, offset in firsts.items()]
    for f in {s[0] for s in spans}:
        with open(f, "rb") as src:
            # Written back first: the kernel drops only clean pages (a file just written
            # is still dirty, and its pages stay until written back).
            os.fsync(src.fileno())
            while src.read(1 << 20):
                pass
    tables = sum(n for _, _, n in spans)
    assert _resident(spans) == tables, "the checkpoint was not in the page cache to begin with"
    d = daemons("--checkpoint", str(checkpoint))
    [ts] = d.status().sets
    assert ts.state == "ready"
    assert _read(d.log, plan)[0] == 0, "a cached checkpoint was read direct"
    # Only the pages a table shares with its neighbours at either end may stay.
    assert _resident(spans) <= 2 * PAGE * len(spans), "the tables are still in the page cache"
    assert _resident(heads) >= sum(n // PAGE * PAGE for _, _, n in heads), "headers dropped"


def _tables(folder: Path) -> Path:
    """Tables whose reads end anywhere in a page: within one page, across one boundary,
    over whole pages, over several 4 MiB reads; and an empty one."""
    g = torch.Generator().manual_seed(3)
    shapes = [(4, 25), (40, 125), (1, 3 * PAGE + 1), (2051, PAGE + 7), (3, 1000), (0, 16)]
    folder.mkdir()
    save_file(
        {
            f"layers.{i}.engram.embed.weight": torch.randint(
                0, 256, shape, dtype=torch.uint8, generator=g
            )
            for i, shape in enumerate(shapes)
        },
        folder / "model.safetensors",
    )
    return folder


def _uncached(folder: Path) -> None:
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # the kernel drops only clean pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert resident_bytes(fd, 0, os.fstat(fd).st_size) == 0
        finally:
            os.close(fd)


def _read(log: str, plan: TablePlan) -> tuple[int, int]:
    """(bytes read direct, bytes through the page cache) of the daemon's load of `plan`, as
    its log tells them (to 0.01 of their unit)."""
    [(direct, cached)] = re.findall(
        rf"set {plan.set_id}: (.+) read direct into its pages, (.+) through the page cache", log
    )
    return parse_size(direct.replace(" ", "")), parse_size(cached.replace(" ", ""))


def _check_copy(shm: Path, plan: TablePlan) -> None:
    """The set's tensors, read back from its files, are the checkpoint's bytes, each at its
    offset in the checkpoint within a page."""
    folder = sets_root(shm) / plan.set_id
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes())
    for placed, planned in zip(manifest.tensors, plan.tensors, strict=True):
        assert placed.offset == planned.offset % DIRECT_ALIGN
        with open(folder / placed.file, "rb") as f:
            f.seek(placed.offset)
            copied = f.read(placed.nbytes)
        expected = b""
        for span in planned.spans:
            with open(span.file, "rb") as f:
                f.seek(span.offset)
                expected += f.read(span.nbytes)
        assert copied == expected, f"{planned.name}: the set's bytes differ from the checkpoint"


@pytest.mark.parametrize("pages", ["huge", "4k"])
def test_a_cold_checkpoint_is_read_direct_into_the_sets_pages(
    pages: str, tmp_path: Path, shm_dir: Path, daemons: Any
) -> None:
    # Huge pages: straight into the set's mapped pages; 4 KiB ones: into the load's own
    # buffers at the file's offset within a page, then written (loader.py, _mapped).
    folder = _tables(tmp_path / "tables")
    plan = plan_tables(folder)
    # Not aligned by chance: direct reads land at the checkpoint's own offsets within pages.
    assert len({t.offset % DIRECT_ALIGN for t in plan.tensors if t.nbytes} - {0}) >= 3
    _uncached(folder)
    d = daemons("--checkpoint", str(folder), *(["--no-huge-tmpfs"] if pages == "4k" else []))
    [ts] = d.status().sets
    assert (ts.page_size > PAGE) == (pages == "huge") or os.geteuid() != 0
    direct, cached = _read(d.log, plan)
    # Planning read the header and a few samples of the data (engramd_shared/headers.py): the
    # tables in those pages, cached by then, are copied from the page cache.
    assert cached <= (SAMPLES + 2) * PAGE and direct >= plan.nbytes - (SAMPLES + 2) * PAGE
    spans = [(s.file, s.offset, s.nbytes) for t in plan.tensors for s in t.spans]
    # Read direct: never in the page cache but for the pages planning read.
    assert _resident(spans) <= (SAMPLES + 2) * PAGE, "the tables went through the page cache"
    _check_copy(shm_dir, plan)


def test_row_shards_at_other_offsets_are_read_through_the_page_cache(
    tmp_path: Path, shm_dir: Path, daemons: Any
) -> None:
    # A table joined from row shards sits at its first shard's offset within a page; the
    # other shards' bytes, in general at other offsets, go through the page cache.
    folder = synthesize_ple(tmp_path / "ple", PleSpec(rows=40_000, parts=7, files=2))
    plan = plan_tables(folder)
    _uncached(folder)
    d = daemons("--checkpoint", str(folder))
    direct, cached = _read(d.log, plan)
    assert direct > plan.nbytes // 10 and cached > plan.nbytes // 10
    _check_copy(shm_dir, plan)


def test_a_file_system_without_direct_reads_is_read_through_the_page_cache(
    tmp_path: Path, shm_dir: Path, daemons: Any
) -> None:
    # ramfs takes no O_DIRECT: the load reads as it can, the same bytes.
    source = _tables(tmp_path / "tables")
    with mounted_ramfs() as ram:
        folder = ram / "tables"
        folder.mkdir()
        for f in source.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        plan = plan_tables(folder)
        d = daemons("--checkpoint", str(folder))
        assert _read(d.log, plan)[0] == 0
        _check_copy(shm_dir, plan)
