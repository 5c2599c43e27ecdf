"""The Qwen4Exp PLE tests' harness: a Qwen4Exp-shaped checkpoint whose PLE tables have the
rows SGLang's Qwen4ExpNGramEmbedding computes, in row shards whose boundaries do not fall
on the TP split, a table's shards spread over two files; and SGLang ranks run as
processes (ple_rank.py).

SGLang's qwen4_exp module imports nothing on CPU beyond what requirements.txt
already lists for the Engram tests (tried in `make test-sglang`'s venv: its
sympy comes with torch, msgspec and triton are listed).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_harness import run_rank_processes, small_readahead_disk

RANK = Path(__file__).resolve().parent / "ple_rank.py"

#: One-indexed, as the config names them: PLE on decoder layers 1 and 3 (linear attention).
PLE_LAYER_IDS = (2, 4)
LAYER_TYPES = ("full_attention", "linear_attention", "full_attention", "linear_attention")
NGRAM_SIZE = 3
HEADS_PER_NGRAM = 2
#: (3 - 1) x 2 = 4 n-gram heads of 2048 columns: a row of 2048 values, so the tables
#: (33 MiB in bf16) dwarf what a rank reads besides them.
PLE_DIM = 8192
VOCAB_BASE = 1000
DIVISIBLE_BY = 128
#: Row shards per table: ceil(rows / 7)-row shards, which no TP split of 2, 3 or 4 meets.
SPLIT_NGRAM_PARTS = 7
HIDDEN = 64
#: fp8 tables' global scale (SGLang's bf16 [1] buffer reads it exactly).
FP8_SCALE = 0.5
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def text_config(dtype: str) -> dict[str, Any]:
    """config.json's text_config: a tiny Qwen4Exp that SGLang's and transformers' configs accept."""
    return {
        "model_type": "qwen4_exp_text",
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": list(LAYER_TYPES),
        "full_attention_interval": 2,
        "vocab_size": 1000,
        "intermediate_size": 128,
        "hc_count": 2,
        "hc_lowrank": 8,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 1,
        "ple_layer_ids": list(PLE_LAYER_IDS),
        "ple_embed_dim": PLE_DIM,
        "ngram_size": NGRAM_SIZE,
        "heads_per_ngram": HEADS_PER_NGRAM,
        "ngram_vocab_size_base": VOCAB_BASE,
        "make_ngram_vocab_size_divisible_by": DIVISIBLE_BY,
        "split_ngram_parts": SPLIT_NGRAM_PARTS,
        # SGLang keeps fp8 tables fp8 only where the config says so.
        "ple_embedding_dtype": "float8_e4m3fn" if dtype == "fp8" else None,
    }


def table_rows() -> tuple[int, ...]:
    """Each PLE layer's rows: its heads' primes (SGLang's own draw), padded as SGLang pads."""
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding as Embedding

    heads = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
    rows = []
    for index in range(len(PLE_LAYER_IDS)):
        layer = SimpleNamespace(
            ngram_heads=heads,
            ple_layer_index=index,
            ngram_vocab_size_base=VOCAB_BASE,
            _find_nth_prime_after=Embedding._find_nth_prime_after,
        )
        _, _, total = Embedding._build_head_vocab_and_offsets(layer)
        rows.append(-(-total // DIVISIBLE_BY) * DIVISIBLE_BY)
    return tuple(rows)


def table_name(layer: int) -> str:
    """The joined table of decoder layer `layer` (engramd's name: the shards' without shard_N)."""
    return f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"


def shard_name(layer: int, shard: int) -> str:
    return (
        f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding."
        f"shard_{shard}.weight"
    )


@dataclass(frozen=True)
class Model:
    """The synthetic checkpoint (on disk), its dtype and its PLE tables' rows per layer."""

    folder: Path
    dtype: str
    rows: tuple[int, ...]

    @property
    def width(self) -> int:
        return PLE_DIM // ((NGRAM_SIZE - 1) * HEADS_PER_NGRAM)

    @property
    def table_bytes(self) -> int:
        return sum(self.rows) * self.width * DTYPES[self.dtype].itemsize

    def shard_size(self, index: int) -> int:
        return -(-self.rows[index] // SPLIT_NGRAM_PARTS)


def full_table(layer_index: int, rows: int, width: int, dtype: str, seed: int = 0) -> torch.Tensor:
    """A PLE layer's whole table: random bytes (fp8: any finite value; bf16: small values);
    another `seed`, other bytes."""
    g = torch.Generator().manual_seed(1000 * seed + 100 + layer_index)
    if dtype == "bf16":
        return torch.randn(rows, width, generator=g).to(torch.bfloat16)
    return (torch.rand(rows, width, generator=g) * 8 - 4).to(torch.float8_e4m3fn)


def make_model(folder: Path, dtype: str, seed: int = 0) -> Model:
    """The PLE tables in row shards over three files, each file ending inside a table, and
    each PLE layer's other weights (value_proj, fp8's scale), which SGLang's loader reads.
    Another `seed`: the tables' next revision (other rows, the same names and shapes; the
    other weights the same)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    rows = table_rows()
    model = Model(folder, dtype, rows)
    tensors: dict[str, torch.Tensor] = {}
    for index, layer_id in enumerate(PLE_LAYER_IDS):
        layer = layer_id - 1
        table = full_table(index, rows[index], model.width, dtype, seed)
        size = model.shard_size(index)
        for shard in range(SPLIT_NGRAM_PARTS):
            tensors[shard_name(layer, shard)] = table[shard * size : (shard + 1) * size].clone()
        prefix = f"model.language_model.layers.{layer}.ple"
        g = torch.Generator().manual_seed(layer)
        tensors[f"{prefix}.value_proj.weight"] = torch.randn(HIDDEN, PLE_DIM, generator=g).to(
            torch.bfloat16
        )
        if dtype == "fp8":
            tensors[f"{prefix}.ple_embedding.ngram_embedding.weight_scale"] = torch.tensor(
                [FP8_SCALE]
            )
    names = list(tensors)
    # 3 files of unequal counts: layer 1's shards 0-3 | the rest of layer 1 and layer 3's
    # first shards | the rest.
    cuts = (4, SPLIT_NGRAM_PARTS + 4, len(names))
    weight_map: dict[str, str] = {}
    first = 0
    for number, cut in enumerate(cuts, 1):
        name = f"model-{number:05d}-of-{len(cuts):05d}.safetensors"
        part = {k: tensors[k] for k in names[first:cut]}
        save_file(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
        first = cut
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text_config(dtype),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="session")
def ple_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder on a disk that counts reads (small readahead), for the PLE checkpoints."""
    base = tmp_path_factory.mktemp("qwen4exp")
    with small_readahead_disk(base) as disk:
        yield disk or base


@pytest.fixture(scope="session", params=["bf16", "fp8"])
def ple_model(request: pytest.FixtureRequest, ple_disk: Path) -> Model:
    """A Qwen4Exp-shaped checkpoint of bf16 or fp8 PLE tables (about 33 or 17 MiB)."""
    dtype = str(request.param)
    folder = ple_disk / f"ckpt-{dtype}"
    if folder.exists():
        return Model(folder, dtype, table_rows())
    return make_model(folder, dtype)


def run_ple_ranks(
    model: Model,
    world: int,
    env: dict[str, str],
    tmp: Path,
    extra: tuple[str, ...] = (),
    timeout: float = 600,
    path: str = "",
) -> list[subprocess.CompletedProcess[str]]:
    """Run `world` SGLang ranks (ple_rank.py) as one TP group; their results. `path`: the
    model path they are given ("": the model's folder)."""
    return run_rank_processes(RANK, world, tmp, path or str(model.folder), env, extra, timeout)


def run_servers(
    model: Model, count: int, env: dict[str, str], tmp: Path, extra: tuple[str, ...] = ()
) -> list[subprocess.CompletedProcess[str]]:
    """Run `count` separate TP1 SGLang engines at once (each its own group); their results."""
    done: list[list[subprocess.CompletedProcess[str]]] = [[] for _ in range(count)]

    def one(index: int) -> None:
        folder = tmp / f"server-{index}"
        folder.mkdir()
        done[index] = run_ple_ranks(model, 1, env, folder, extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [d[0] for d in done]
