"""The vLLM plugin's tests' harness: a DeepSeek-V4.1-shaped checkpoint, vLLM's config
of it, and ranks of vLLM run as processes (vllm_rank.py).

These tests run in their own venv (`make test-vllm`: vLLM 0.33.0 without its
CUDA dependencies, CPU torch); the main suite does not collect this folder.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import run_rank_processes, small_readahead_disk

from engramd.demo.synth import SynthSpec, synthesize

RANK = Path(__file__).resolve().parent / "vllm_rank.py"

#: DeepSeek-V4.1's Engram shape, small: 3 Engram layers of (3 - 1) x 5 = 10 prime-sized
#: hash heads (10 heads over 4 TP ranks: vLLM gives 3/3/3/1), 256-wide fp8 rows.
LAYERS = 3
N_HEADS = 5
MAX_NGRAM = 3
HEAD_DIM = 256
VOCAB = 4000
HIDDEN = 64
HC_MULT = 2


def text_config(num_embeddings: list[int]) -> dict[str, Any]:
    spec = SynthSpec(layers=LAYERS)
    return {
        "hidden_size": HIDDEN,
        "hc_mult": HC_MULT,
        "rms_norm_eps": 1e-6,
        "num_hidden_layers": max(spec.engram_layers) + 1,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "engram_layer_ids": spec.engram_layers,
        "engram_num_embeddings": num_embeddings,
        "engram_max_ngram_size": MAX_NGRAM,
        "engram_n_heads": N_HEADS,
        "engram_head_dim": HEAD_DIM,
        "engram_vocab_size": VOCAB,
        "engram_compressed_vocab_size": 900,
        "engram_pad_token_id": 0,
    }


def head_sizes() -> list[list[int]]:
    """Each Engram layer's hash-head sizes, as vLLM's EngramLayout draws them."""
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.common.engram import EngramLayout

    layout = EngramLayout(SimpleNamespace(**text_config([0] * LAYERS)))
    return [[p for order in layer for p in order] for layer in layout.primes]


@dataclass(frozen=True)
class Model:
    """The synthetic checkpoint and vLLM's pickled config of it."""

    folder: Path
    config: Path
    spec: SynthSpec
    heads: list[list[int]]


def _extra_tensors(folder: Path, spec: SynthSpec) -> None:
    """The Engram layers' other weights (wkv, q/k), in a shard of their own."""
    from safetensors.torch import save_file

    n_hash_cols = (MAX_NGRAM - 1) * N_HEADS
    tensors = {}
    for layer in spec.engram_layers:
        g = torch.Generator().manual_seed(layer)
        tensors[f"layers.{layer}.engram.wkv.weight"] = torch.randn(
            HIDDEN * (HC_MULT + 1), n_hash_cols * HEAD_DIM, generator=g
        ).to(torch.bfloat16)
        for name in ("q_weight", "k_weight"):
            tensors[f"layers.{layer}.engram.{name}"] = torch.randn(HC_MULT, HIDDEN, generator=g).to(
                torch.bfloat16
            )
    name = "model-extra.safetensors"
    save_file(tensors, str(folder / name))
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: name for k in tensors})
    index_path.write_text(json.dumps(index, indent=2))


def make_model(folder: Path) -> Model:
    """Write the checkpoint into `folder` (on disk: the tests count reads) and vLLM's config."""
    from vllm.config import DeviceConfig, EngramConfig, LoadConfig, ModelConfig, VllmConfig

    heads = head_sizes()
    rows = max(sum(h) for h in heads)
    spec = SynthSpec(layers=LAYERS, rows=rows, dim=HEAD_DIM, shards=2)
    synthesize(folder, spec)
    _extra_tensors(folder, spec)
    config = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text_config([rows] * LAYERS),
    }
    (folder / "config.json").write_text(json.dumps(config))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True),
        engram_config=EngramConfig(),
        load_config=LoadConfig(),
        device_config=DeviceConfig("cpu"),
    )
    pickled = folder.parent / "vllm_config.pkl"
    pickled.write_bytes(pickle.dumps(vllm_config))
    return Model(folder, pickled, spec, heads)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """A DeepSeek-V4.1-shaped checkpoint on disk (about 32 MB of Engram tables)."""
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
) -> list[subprocess.CompletedProcess[str]]:
    """Run `world` vLLM ranks (tests/vllm_plugin/vllm_rank.py) as one TP group; their results."""
    return run_rank_processes(RANK, world, tmp, str(model.config), env, extra, timeout)


@pytest.fixture
def served(model: Model, daemons: Any) -> Iterator[Any]:
    """A daemon serving the checkpoint (loaded at start)."""
    yield daemons("--checkpoint", str(model.folder))
