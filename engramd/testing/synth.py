"""Write a synthetic Engram checkpoint whose every byte can be recomputed.

Per layer L: `layers.{L}.engram.embed.weight` (F8_E4M3, [rows, dim]) and
`layers.{L}.engram.embed.scale` (F8_E8M0, [rows, dim / 32]), beside a few
ordinary tensors that the default selection must skip, sharded over several
files with a `model.safetensors.index.json`, as a Hugging Face export looks.

Row r of a table is a function of (seed, layer, table, r) alone
(`expected_rows`), so a reader can check any gathered row without a second
copy of the table. The files are written by a streaming safetensors writer
(the format is an 8-byte header length, a JSON header, the data); the tests
read them back with the reference `safetensors` package.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engramd_shared.checkpoint import INDEX_FILE
from engramd_shared.headers import DTYPES

SCALE_GROUP = 32
# Rows generated per step: bounds the temporaries to a few tens of MiB.
_ROWS_PER_STEP = 1 << 16
_M1 = 0x3F58476D1CE4E5B9
_M2 = 0x14D049BB133111EB


def _mix(x: torch.Tensor) -> torch.Tensor:
    # splitmix64's finalizer in int64 arithmetic (wrapping multiply).
    x = (x ^ (x >> 31)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 33)


def expected_rows(
    seed: int, layer: int, table: str, rows: torch.Tensor, width: int
) -> torch.Tensor:
    """The bytes (uint8, [len(rows), width]) of the given rows of a synthetic table."""
    salt = seed * 1_000_003 + layer * 7_919 + (0 if table == "weight" else 104_729)
    keys = _mix(rows.to(torch.int64) * 2 + salt * 0x2545F491 + 1)
    key_bytes = keys.view(torch.uint8).view(-1, 8)
    tiled = key_bytes.repeat(1, -(-width // 8))[:, :width]
    if table == "weight":
        columns = (torch.arange(width, dtype=torch.int32) * 157 + 11).to(torch.uint8)
        out = tiled ^ columns
        # 0x7F and 0xFF are NaN in float8_e4m3fn; real weights hold none.
        return torch.where((out & 0x7F) == 0x7F, out ^ 1, out)
    # E8M0 scales between 2^-9 and 2^10, as a quantizer would produce.
    return 118 + tiled % 20


@dataclass(frozen=True)
class SynthSpec:
    """Shape of a synthetic checkpoint."""

    layers: int = 2
    rows: int = 1_000_000
    dim: int = 256
    shards: int = 2
    seed: int = 0

    @property
    def engram_layers(self) -> list[int]:
        """Layer numbers that carry Engram tables (1, 3, ... as in DeepSeek's)."""
        return [1 + 2 * i for i in range(self.layers)]

    @property
    def table_bytes(self) -> int:
        """Bytes of every Engram table together."""
        return self.layers * self.rows * (self.dim + self.dim // SCALE_GROUP)


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Iterator[bytes] | None  # None: deterministic filler

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]


def seeds_held(tables: Mapping[str, torch.Tensor], rows: int = 64) -> set[int | None]:
    """The seed (0 or 1) of the synthetic checkpoint whose rows each Engram table holds, by
    sampled rows; None for neither (a mix of generations shows as two seeds)."""
    found: set[int | None] = set()
    for name, tensor in tables.items():
        layer, kind = int(name.split(".")[1]), name.rsplit(".", 1)[1]
        table = tensor.view(torch.uint8)
        picked = torch.randint(0, table.shape[0], (rows,))
        got = table.index_select(0, picked)
        matching = [
            seed
            for seed in (0, 1)
            if torch.equal(got, expected_rows(seed, layer, kind, picked, table.shape[1]))
        ]
        found.add(matching[0] if matching else None)
    return found


def _table(spec: SynthSpec, layer: int, table: str) -> _Tensor:
    width = spec.dim if table == "weight" else spec.dim // SCALE_GROUP
    dtype = "F8_E4M3" if table == "weight" else "F8_E8M0"

    def chunks() -> Iterator[bytes]:
        for start in range(0, spec.rows, _ROWS_PER_STEP):
            rows = torch.arange(start, min(start + _ROWS_PER_STEP, spec.rows))
            yield expected_rows(spec.seed, layer, table, rows, width).numpy().tobytes()

    return _Tensor(f"layers.{layer}.engram.embed.{table}", dtype, (spec.rows, width), chunks())


def _ordinary(spec: SynthSpec, layer: int) -> list[_Tensor]:
    hidden = 64
    return [
        _Tensor(f"layers.{layer}.attn.wq.weight", "BF16", (hidden, hidden), None),
        _Tensor(f"layers.{layer}.ffn.norm.weight", "F32", (hidden,), None),
    ]


def write_safetensors(path: Path, tensors: list[_Tensor]) -> int:
    """Stream tensors into one safetensors file; returns its data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            if t.chunks is None:
                f.write(bytes((i * 37 + 5) % 251 for i in range(t.nbytes)))
                continue
            for chunk in t.chunks:
                f.write(chunk)
    return offset


def synthesize(out: str | Path, spec: SynthSpec) -> Path:
    """Write a sharded Engram checkpoint into folder `out` and return it."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[_Tensor]] = [[] for _ in range(spec.shards)]
    shards[0].append(_Tensor("embed_tokens.weight", "BF16", (1024, 64), None))
    for i, layer in enumerate(spec.engram_layers):
        shard = shards[i % spec.shards]
        shard.extend(_ordinary(spec, layer))
        shard.extend(_table(spec, layer, t) for t in ("weight", "scale"))
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors"
        total += write_safetensors(folder / name, tensors)
        weight_map.update({t.name: name for t in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return folder


#: Qwen4Exp's PLE table formats: the weight's dtype and row bytes per value, and NVFP4's
#: block scales (one F8_E4M3 per 16 values).
PLE_FORMATS = ("BF16", "F8_E4M3", "NVFP4")
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class PleSpec:
    """Shape of a synthetic Qwen4Exp checkpoint: PLE n-gram tables in row shards."""

    #: Decoder layers that carry a PLE table.
    layers: tuple[int, ...] = (0, 2)
    #: Rows of each table (the vocabulary, already padded as vLLM pads it).
    rows: int = 1000
    #: Rows of each layer's table, where they differ (as many as `layers`).
    layer_rows: tuple[int, ...] = ()
    #: Values per row.
    dim: int = 64
    #: Row shards per table (`split_ngram_parts`): shard_size = ceil(rows / parts).
    parts: int = 7
    #: PLE_FORMATS.
    fmt: str = "BF16"
    #: Files the shards are spread over.
    files: int = 2
    seed: int = 0
    #: What the names start with (Qwen4ExpForConditionalGeneration: model.language_model).
    prefix: str = "model"
    architecture: str = "Qwen4ExpForCausalLM"

    def rows_of(self, layer: int) -> int:
        """Rows of a layer's table."""
        return self.layer_rows[self.layers.index(layer)] if self.layer_rows else self.rows

    def shard_rows(self, layer: int) -> int:
        """Rows of every shard of a layer's table but the last."""
        return -(-self.rows_of(layer) // self.parts)

    def table(self, layer: int) -> str:
        """The name of a layer's table, without `.shard_N.weight`."""
        return f"{self.prefix}.layers.{layer}.ple.ple_embedding.ngram_embedding"

    def widths(self) -> dict[str, tuple[str, int]]:
        """Each sharded part (weight, NVFP4's weight_scale): its dtype and bytes per row."""
        if self.fmt == "NVFP4":
            return {"weight": ("U8", self.dim // 2), "weight_scale": ("F8_E4M3", self.dim // 16)}
        return {"weight": (self.fmt, self.dim * DTYPES[self.fmt][0])}

    @property
    def table_bytes(self) -> int:
        """Bytes of every PLE table together (every part of every shard)."""
        row = sum(width for _, width in self.widths().values())
        return sum(self.rows_of(layer) for layer in self.layers) * row


def expected_ple_rows(spec: PleSpec, layer: int, part: str, rows: torch.Tensor) -> torch.Tensor:
    """The bytes (uint8, [len(rows), row bytes]) of rows of a synthetic PLE table's `part`."""
    return expected_rows(spec.seed, layer, part, rows, spec.widths()[part][1])


def synthesize_ple(out: str | Path, spec: PleSpec) -> Path:
    """Write a Qwen4Exp-style checkpoint with PLE tables in row shards into folder `out`."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files: list[list[_Tensor]] = [[] for _ in range(spec.files)]
    files[0].append(_Tensor(f"{spec.prefix}.embed_tokens.weight", "BF16", (1024, 64), None))
    count = 0
    for layer in spec.layers:
        table = spec.table(layer)
        if spec.fmt == "F8_E4M3":
            files[0].append(_Tensor(f"{table}.weight_scale", "F32", (1,), None))
        if spec.fmt == "NVFP4":
            files[0].append(_Tensor(f"{table}.weight_scale_2", "F32", (1,), None))
        for shard in range(spec.parts):
            start = shard * spec.shard_rows(layer)
            stop = min(start + spec.shard_rows(layer), spec.rows_of(layer))
            for part, (dtype, width) in spec.widths().items():
                rows = torch.arange(start, stop)
                data = expected_ple_rows(spec, layer, part, rows).numpy().tobytes()
                shape = (stop - start, width if dtype == "U8" else width // DTYPES[dtype][0])
                files[count % spec.files].append(
                    _Tensor(f"{table}.shard_{shard}.{part}", dtype, shape, iter([data]))
                )
            count += 1
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{spec.files:05d}.safetensors"
        total += write_safetensors(folder / name, tensors)
        weight_map.update({t.name: name for t in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = {"architectures": [spec.architecture], "ple_layer_ids": [i + 1 for i in spec.layers]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
