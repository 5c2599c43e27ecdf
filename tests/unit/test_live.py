"""live.py: one range of addresses for a tensor's life, backings mapped into it in place."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engramd_client.live import Backing, LiveAddress, Piece, delta_for, file_backing
from engramd_client.mapping import Region

ROW = 96
ROWS = 1_000


@pytest.fixture
def files(tmp_path: Path) -> Iterator[list[Path]]:
    """Two files of the same layout, other bytes: a table at offset 8192, rows of 96 bytes."""
    made = []
    for seed in (1, 2):
        data = torch.randint(0, 256, (ROWS * ROW,), generator=torch.Generator().manual_seed(seed))
        path = tmp_path / f"set-{seed}"
        path.write_bytes(b"\xee" * 8192 + data.to(torch.uint8).numpy().tobytes() + b"\xee" * 100)
        made.append(path)
    yield made


def _region(path: Path, start: int, stop: int, pad: int = 0) -> Region:
    whole = Region("t", "U8", (ROWS, ROW), str(path), 8192, ROWS * ROW)
    rows = {"t": (start, stop + pad)}
    return whole.cut(rows, pad_rows=bool(pad))


def _rows(path: Path, start: int, stop: int) -> bytes:
    with path.open("rb") as f:
        f.seek(8192 + start * ROW)
        return f.read((stop - start) * ROW)


def test_a_backing_is_replaced_under_the_same_address(files: list[Path]) -> None:
    region = _region(files[0], 37, 900)
    live = LiveAddress(region.length, delta_for(region.offset))
    live.apply(file_backing(os.open(files[0], os.O_RDONLY), region, live))
    tensor = live.tensor(torch.uint8, (863, ROW))
    address = tensor.data_ptr()
    assert address == live.address
    assert tensor.numpy().tobytes() == _rows(files[0], 37, 900)
    live.apply(file_backing(os.open(files[1], os.O_RDONLY), _region(files[1], 37, 900), live))
    assert tensor.data_ptr() == address
    assert tensor.numpy().tobytes() == _rows(files[1], 37, 900)


def test_padding_rows_are_zeros_and_the_last_partial_page_a_copy(files: list[Path]) -> None:
    region = _region(files[0], 950, ROWS, pad=64)
    live = LiveAddress(region.length + region.pad, delta_for(region.offset))
    backing = file_backing(os.open(files[0], os.O_RDONLY), region, live)
    # The file's bytes after the table never show as padding: the partial page is copied.
    assert backing.own
    live.apply(backing)
    tensor = live.tensor(torch.uint8, (114, ROW))
    assert tensor[:50].numpy().tobytes() == _rows(files[0], 950, ROWS)
    assert not tensor[50:].any()
    backing.close()


def test_rows_within_one_partial_page_land_at_their_place(files: list[Path]) -> None:
    # The held rows end before their page does, pages into the range: no shared page at
    # all, only the copied one, which goes where the rows are, not at the range's start.
    region = _region(files[0], 990, ROWS, pad=10)
    assert region.offset % 4096 + region.length < 4096 <= delta_for(region.offset)
    live = LiveAddress(region.length + region.pad, delta_for(region.offset))
    backing = file_backing(os.open(files[0], os.O_RDONLY), region, live)
    assert not backing.pieces and backing.own
    live.apply(backing)
    tensor = live.tensor(torch.uint8, (20, ROW))
    assert tensor[:10].numpy().tobytes() == _rows(files[0], 990, ROWS)
    assert not tensor[10:].any()
    backing.close()


def test_pages_off_their_boundary_are_refused_before_anything_moves(files: list[Path]) -> None:
    region = _region(files[0], 0, 10)
    live = LiveAddress(region.length, delta_for(region.offset))
    fd = os.open(files[0], os.O_RDONLY)
    try:
        huge = Backing([Piece(4096, 4096, fd, 0, 2 << 20)])
        why = live.misfit(huge)
        assert why is not None and "not on a page of their size" in why
        outside = Backing([Piece(0, live.size + (2 << 20), fd, 0, 4096)])
        assert "outside the tensor's range" in str(live.misfit(outside))
    finally:
        os.close(fd)
