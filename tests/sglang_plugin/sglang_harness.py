"""The SGLang plugin's tests' harness: a DeepSeek-V4.1-shaped checkpoint whose Engram
tables have the sizes SGLang's EngramLayout computes, and SGLang ranks run as
processes (sglang_rank.py).

These tests run in their own venv (`make test-sglang`: SGLang 0.5.23 without its
CUDA dependencies, CPU torch); the main suite does not collect this folder.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_harness import InBucket, in_bucket, run_rank_processes, small_readahead_disk

RANK = Path(__file__).resolve().parent / "sglang_rank.py"

#: 3 Engram layers of (3 - 1) x 3 = 6 hash columns: TP 2 and 3 split them on column
#: boundaries, TP 4 falls to SGLang's even-row split (not on head boundaries).
LAYER_IDS = (1, 3, 5)
N_HEADS = 3
MAX_NGRAM = 3
HEAD_DIM = 256
VOCAB = 4000
HIDDEN = 64
HC_MULT = 2
FP8_BLOCK = 32


def engram_config(num_embeddings: tuple[int, ...]) -> SimpleNamespace:
    """The config fields SGLang's EngramLayout and Engram layer read."""
    return SimpleNamespace(
        engram_layer_ids=LAYER_IDS,
        engram_max_ngram_size=MAX_NGRAM,
        engram_n_heads=N_HEADS,
        engram_vocab_size=VOCAB,
        engram_head_dim=HEAD_DIM,
        engram_num_embeddings=num_embeddings,
        hidden_size=HIDDEN,
        hc_mult=HC_MULT,
        rms_norm_eps=1e-6,
    )


def table_rows() -> tuple[int, ...]:
    """Each Engram layer's rows: the sum of its hash heads' primes, as SGLang draws them."""
    from sglang.srt.layers.engram import EngramLayout

    layout = EngramLayout.from_config(engram_config((0,) * len(LAYER_IDS)))
    assert layout is not None
    return tuple(layout.column_bounds(i)[-1] for i in range(len(LAYER_IDS)))


@dataclass(frozen=True)
class Model:
    """The synthetic checkpoint (on disk) and its Engram tables' rows per layer."""

    folder: Path
    rows: tuple[int, ...]

    @property
    def table_bytes(self) -> int:
        return sum(r * (HEAD_DIM + HEAD_DIM // FP8_BLOCK) for r in self.rows)


def make_model(folder: Path, seed: int = 0) -> Model:
    """fp8 weights and e8m0 scales of random bytes, with the Engram layers' other weights
    (`seed`: another revision's bytes, the same names and shapes)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    rows = table_rows()
    weight_map: dict[str, str] = {}
    for index, (layer, n) in enumerate(zip(LAYER_IDS, rows, strict=True)):
        g = torch.Generator().manual_seed(layer + 1000 * seed)
        byte = torch.uint8
        tensors = {
            f"layers.{layer}.engram.embed.weight": torch.randint(
                0, 256, (n, HEAD_DIM), dtype=byte, generator=g
            ).view(torch.float8_e4m3fn),
            f"layers.{layer}.engram.embed.scale": torch.randint(
                0, 256, (n, HEAD_DIM // FP8_BLOCK), dtype=byte, generator=g
            ).view(torch.float8_e8m0fnu),
            f"layers.{layer}.engram.wkv.weight": torch.randn(
                HIDDEN * (HC_MULT + 1), (MAX_NGRAM - 1) * N_HEADS * HEAD_DIM, generator=g
            ).to(torch.bfloat16),
            f"layers.{layer}.engram.q_weight": torch.randn(HC_MULT, HIDDEN, generator=g),
            f"layers.{layer}.engram.k_weight": torch.randn(HC_MULT, HIDDEN, generator=g),
        }
        name = f"model-{index + 1:05d}-of-{len(LAYER_IDS):05d}.safetensors"
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index_file = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file))
    # What SGLang's ServerArgs reads to publish the model path (the ranks build
    # their Engram layers from engram_config, not from this file).
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_hidden_layers": max(LAYER_IDS) + 1,
        "vocab_size": 1024,
        "intermediate_size": 128,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return Model(folder, rows)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """A DeepSeek-V4.1-shaped checkpoint on disk (about 20 MB of Engram tables)."""
    base = tmp_path_factory.mktemp("dsv41")
    with small_readahead_disk(base) as disk:
        yield make_model((disk or base) / "ckpt")


def run_ranks(
    model: Model,
    world: int,
    env: dict[str, str],
    tmp: Path,
    extra: tuple[str, ...] = (),
    timeout: float = 600,
    path: str = "",
) -> list[subprocess.CompletedProcess[str]]:
    """Run `world` SGLang ranks (sglang_rank.py) as one TP group; their results. `path`: the
    model path they are given ("": the model's folder)."""
    env = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1", **env}
    return run_rank_processes(RANK, world, tmp, path or str(model.folder), env, extra, timeout)


@pytest.fixture
def served(model: Model, daemons: Any) -> Iterator[Any]:
    """A daemon serving the checkpoint (loaded at start)."""
    yield daemons("--checkpoint", str(model.folder))


@pytest.fixture
def stored(model: Model, daemons: Any, tmp_path: Path) -> Iterator[InBucket]:
    """`model` in a bucket, and the daemon that loaded it from there (engine_harness)."""
    with in_bucket(model.folder, daemons, tmp_path) as bucket:
        yield bucket
