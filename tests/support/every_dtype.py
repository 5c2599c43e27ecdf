"""A checkpoint of every safetensors dtype (tests/daemon/test_attach.py, tests/gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Every safetensors dtype the issue names, plus a few more.
DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e8m0fnu,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, dtype in enumerate(DTYPES):
        rows, cols = 301 + i, 24
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (rows * cols * itemsize,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw &= 1
        out[f"layers.{i}.engram.embed.weight"] = raw.view(dtype).view(rows, cols)
    out["layers.99.engram.embed.weight"] = torch.empty(0, 16, dtype=torch.bfloat16)
    out["layers.0.attn.wq.weight"] = torch.ones(8, 8)  # not selected
    return out


def write_checkpoint(folder: Path, sharded: bool) -> Path:
    """All dtypes, in one model.safetensors or two shards with an index."""
    folder.mkdir(parents=True)
    tensors = _tensors()
    if not sharded:
        save_file(tensors, folder / "model.safetensors")
        return folder
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder
