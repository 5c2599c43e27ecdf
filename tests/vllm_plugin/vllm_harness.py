"""The vLLM plugin's tests' harness: DeepSeek-V4.1- and Qwen4Exp-shaped checkpoints,
vLLM's configs of them, and ranks of vLLM run as processes (vllm_rank.py,
vllm_ple_rank.py).

These tests run in their own venv (`make test-vllm`: vLLM 0.33.0 without its
CUDA dependencies, CPU torch); the main suite does not collect this folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import InBucket, in_bucket, run_rank_processes, small_readahead_disk

from engramd.testing.synth import PleSpec, SynthSpec, synthesize, synthesize_ple

RANK = Path(__file__).resolve().parent / "vllm_rank.py"
PLE_RANK = Path(__file__).resolve().parent / "vllm_ple_rank.py"

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


def revision(model: Model, folder: Path) -> Path:
    """A copy of the model's checkpoint in `folder` whose Engram tables hold other rows
    (synthetic seed 1), the same names and shapes: the tables' next revision."""
    shutil.copytree(model.folder, folder)
    synthesize(folder, dataclasses.replace(model.spec, seed=1))
    _extra_tensors(folder, model.spec)
    return folder


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


@dataclass(frozen=True)
class Stored:
    """vLLM's config of the checkpoint as an s3:// model streamed by runai_streamer, and the
    bucket (and daemon) it is in."""

    model: Model
    bucket: InBucket


@contextlib.contextmanager
def bucket_config(
    folder: Path, daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Path, InBucket]]:
    """The checkpoint in `folder` in a bucket (engine_harness.in_bucket): the folder vLLM
    pulled its config files to from there, vLLM's pickled config of the URL as the model
    streamed by runai_streamer, and the bucket."""
    from vllm.config import DeviceConfig, EngramConfig, LoadConfig, ModelConfig, VllmConfig

    with in_bucket(folder, daemons, tmp_path) as bucket:
        for key, value in bucket.env.items():
            monkeypatch.setenv(key, value)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=bucket.url, skip_tokenizer_init=True),
            engram_config=EngramConfig(),
            load_config=LoadConfig(load_format="runai_streamer"),
            device_config=DeviceConfig("cpu"),
        )
        pickled = tmp_path / "vllm_config_s3.pkl"
        pickled.write_bytes(pickle.dumps(vllm_config))
        yield Path(vllm_config.model_config.model), pickled, bucket


@pytest.fixture
def stored(
    model: Model, daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stored]:
    """`model` in a bucket; vLLM's config of its URL as the model (bucket_config)."""
    with bucket_config(model.folder, daemons, tmp_path, monkeypatch) as (pulled, pickled, bucket):
        yield Stored(Model(pulled, pickled, model.spec, model.heads), bucket)


#: Qwen4Exp's PLE shape, small: PLE on decoder layers 1 and 3 (ple_layer_ids 2, 4), 2 n-gram
#: heads of a prime near 500 rows each, 64 values per head: vLLM pads each table to a
#: multiple of 64 (1024 and 1088 rows) and splits it in 7 row shards (147 and 156 rows),
#: whose boundaries no rank range of TP 2 or 4 falls on.
PLE_TEXT: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "architectures": ["Qwen4ExpForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "eos_token_id": 2,
    "max_position_embeddings": 2048,
    "layer_types": ["full_attention", "linear_attention"] * 2,
    "ple_layer_ids": [2, 4],
    "ple_embed_dim": 128,
    "ngram_size": 2,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 500,
    "make_ngram_vocab_size_divisible_by": 64,
    "split_ngram_parts": 7,
}
#: engramd's synthetic formats -> Qwen4Exp's `ple_embedding_dtype` (None: unquantized bf16).
PLE_DTYPES = {"BF16": None, "F8_E4M3": "float8_e4m3fn", "NVFP4": "nvfp4"}


@dataclass(frozen=True)
class PleModel:
    """A synthetic Qwen4Exp checkpoint, its PLE tables' spec and vLLM's pickled config."""

    folder: Path
    config: Path
    spec: PleSpec

    @property
    def table_bytes(self) -> int:
        """Bytes of every PLE table (every part) of the checkpoint."""
        return sum(
            self.spec.rows_of(layer) * width
            for layer in self.spec.layers
            for _, width in self.spec.widths().values()
        )


def ple_rows(text: dict[str, Any]) -> tuple[int, ...]:
    """Each PLE layer's table rows, as vLLM's Qwen4ExpNGramEmbedding lays them out and pads."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    divisor = text["make_ngram_vocab_size_divisible_by"]
    rows = []
    for dense_id in range(len(text["ple_layer_ids"])):
        _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
            ngram_vocab_size_base=text["ngram_vocab_size_base"],
            ngram_heads=heads,
            ple_dense_layer_id=dense_id,
        )
        rows.append(-(-total // divisor) * divisor)
    return tuple(rows)


def make_ple_model(folder: Path, fmt: str, vocab_base: int | None = None) -> PleModel:
    """Write a Qwen4Exp checkpoint of PLE tables in `fmt` and vLLM's config of it.

    `vocab_base`: rows per n-gram head (about), instead of the tests' 500.
    """
    from vllm.config import DeviceConfig, EngramConfig, LoadConfig, ModelConfig, VllmConfig

    text = {**PLE_TEXT, "ngram_vocab_size_base": vocab_base or PLE_TEXT["ngram_vocab_size_base"]}
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    spec = PleSpec(
        layers=tuple(i - 1 for i in text["ple_layer_ids"]),
        layer_rows=ple_rows(text),
        dim=text["ple_embed_dim"] // heads,
        parts=text["split_ngram_parts"],
        fmt=fmt,
    )
    synthesize_ple(folder, spec)
    config = {**text, "torch_dtype": "bfloat16"}
    if PLE_DTYPES[fmt]:
        config["ple_embedding_dtype"] = PLE_DTYPES[fmt]
    (folder / "config.json").write_text(json.dumps(config))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True),
        engram_config=EngramConfig(),
        load_config=LoadConfig(),
        device_config=DeviceConfig("cpu"),
    )
    pickled = folder.parent / f"vllm_config_{fmt}.pkl"
    pickled.write_bytes(pickle.dumps(vllm_config))
    return PleModel(folder, pickled, spec)


def ple_revision(model: PleModel, folder: Path) -> Path:
    """The model's PLE tables with other rows (synthetic seed 1), the same names and shapes,
    in `folder` beside the model's config.json: the tables' next revision."""
    synthesize_ple(folder, dataclasses.replace(model.spec, seed=1))
    shutil.copyfile(model.folder / "config.json", folder / "config.json")
    return folder


@pytest.fixture(scope="session")
def ple_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PleModel]]:
    """A Qwen4Exp checkpoint per PLE format (bf16, fp8, NVFP4), on a disk that counts reads."""
    base = tmp_path_factory.mktemp("qwen4exp")
    with small_readahead_disk(base) as disk:
        yield {fmt: make_ple_model((disk or base) / fmt, fmt) for fmt in PLE_DTYPES}


def run_ple_ranks(
    model: PleModel,
    world: int,
    env: dict[str, str],
    tmp: Path,
    extra: tuple[str, ...] = (),
) -> list[subprocess.CompletedProcess[str]]:
    """Run `world` vLLM ranks building the PLE layers (vllm_ple_rank.py) as one TP group."""
    return run_rank_processes(PLE_RANK, world, tmp, str(model.config), env, extra, 600)
