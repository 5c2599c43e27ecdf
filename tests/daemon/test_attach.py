"""Attached tensors equal the reference reader's, byte for byte, for every dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from every_dtype import write_checkpoint
from safetensors.torch import load_file

from engramd_client import attach


def reference(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read by the reference implementation."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single-file"])
def test_every_dtype_byte_exact(tmp_path: Path, daemons: Any, sharded: bool) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", sharded)
    d = daemons("--allow-root", str(tmp_path))
    expected = reference(ckpt)
    selected = sorted(n for n in expected if ".engram.embed." in n)
    with attach(ckpt, socket=str(d.socket), share=True) as tables:
        assert tables.mode == "shared"
        assert sorted(tables) == selected
        for name in tables:
            got = tables[name]
            assert got.dtype == expected[name].dtype, name
            assert got.shape == expected[name].shape, name
            assert raw(got) == raw(expected[name]), name
    [s] = d.status().sets
    assert s.state == "ready" and s.bytes == sum(
        expected[n].numel() * expected[n].element_size() for n in selected
    )


def test_row_ranges_map_only_those_rows(tmp_path: Path, daemons: Any) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", sharded=True)
    d = daemons("--allow-root", str(tmp_path))
    expected = reference(ckpt)
    rows = {
        "layers.0.engram.embed.weight": (5, 17),  # float8, unaligned start
        "layers.3.engram.embed.weight": (100, 304),  # bfloat16 up to the last row
        "layers.6.engram.embed.weight": (0, 0),  # an empty range
    }
    with attach(ckpt, socket=str(d.socket), share=True, rows=rows) as tables:
        for name, (start, stop) in rows.items():
            assert raw(tables[name]) == raw(expected[name][start:stop]), name
        whole = "layers.1.engram.embed.weight"
        assert raw(tables[whole]) == raw(expected[whole])
    with attach(ckpt, share=False, rows=rows) as private:
        for name, (start, stop) in rows.items():
            assert raw(private[name]) == raw(expected[name][start:stop]), name


def test_bad_row_ranges_are_refused(tmp_path: Path, checkpoint: Path) -> None:
    name = "layers.1.engram.embed.weight"
    with pytest.raises(ValueError, match="outside"):
        attach(checkpoint, share=False, rows={name: (10, 40_001)})
    with pytest.raises(ValueError, match="not selected"):
        attach(checkpoint, share=False, rows={"layers.1.attn.wq.weight": (0, 1)})


def test_private_equals_reference(checkpoint: Path) -> None:
    expected = reference(checkpoint)
    with attach(checkpoint, share=False) as tables:
        assert tables.mode == "private" and tables.reason is None
        for name in tables:
            assert raw(tables[name]) == raw(expected[name]), name
