"""The vLLM plugin's compatibility guard: the version and every seam the plugin relies on.

Each check raises UnknownEngine naming the seam that differs; the plugin
then patches nothing of that family and vLLM runs its own path.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from engramd_client.engines.common import SERVED_LOAD_FORMATS, Engine, params

#: vLLM as the guard names it, with the versions whose seams this plugin was written
#: against and tested with. runai_streamer (vLLM's RunaiModelStreamerLoader, an s3:// model
#: streamed from object storage) is served too: its iterator reads whole files and skips
#: nothing, and the plugin withholds the served tables from the layers (process.py).
VLLM = Engine("vLLM", frozenset({"0.33.0"}), SERVED_LOAD_FORMATS | {"runai_streamer"})


def vllm_version() -> str:
    """The running vLLM's version (`vllm.version.__version__`)."""
    from vllm import version

    return str(version.__version__)


def check_loader_seams(
    weight_utils: ModuleType, default_loader: ModuleType, runai_loader: ModuleType
) -> None:
    """The weight loading both families rely on: the iterators' filter, runai_streamer's
    iterator as its loader calls it, the loaded-names count."""
    VLLM.expect(
        params(weight_utils.should_skip_weight) == ["weight_name", "local_expert_ids"]
        # Compiled with the `regex` package: anything with search() will do.
        and callable(getattr(getattr(weight_utils, "_ENGRAM_WEIGHT_RE", None), "search", None)),
        "weight_utils",
    )
    loader = getattr(default_loader, "DefaultModelLoader", None)
    VLLM.expect(
        loader is not None
        and params(loader.track_weights_loading) == ["self", "model", "loaded_weights", "quantized"]
        and params(loader._get_weights_iterator) == ["self", "source"],
        "DefaultModelLoader",
    )
    runai = getattr(runai_loader, "runai_safetensors_weights_iterator", None)
    VLLM.expect(
        runai is not None
        and params(runai) == ["hf_weights_files", "use_tqdm_on_load", "is_distributed"],
        "runai_streamer_loader",
    )


def check_engram_seams(engram: ModuleType) -> None:
    """DeepSeek-V4.1's Engram layer and table, as deepseek.py uses them."""
    table = getattr(engram, "ParallelEngramEmbedding", None)
    layer = getattr(engram, "Engram", None)
    VLLM.expect(table is not None and layer is not None, "Engram module")
    assert table is not None and layer is not None
    VLLM.expect(params(layer._create_embedding) == ["self", "layout", "layer_hash_index"], "Engram")
    VLLM.expect(params(table._allocate_weights) == ["self"], "ParallelEngramEmbedding")
    names = set(table.__init__.__code__.co_names)
    needed = {"vocab_start_idx", "vocab_end_idx", "part_num_embeddings", "cpu_offload"}
    needed |= {"peer_rows", "dim", "block_size", "_views", "_view_src", "_get_shard_info"}
    needed |= {"_allocate_weights", "_weight_loader", "weight", "weight_scale_inv"}
    VLLM.expect(needed <= names, "ParallelEngramEmbedding attributes")
    VLLM.expect(
        {"_views", "_view_src", "_shared_memory"} <= set(table._storage.__code__.co_names),
        "ParallelEngramEmbedding._storage",
    )
    VLLM.expect(
        {"layer_ids", "primes"} <= set(engram.EngramLayout.__init__.__code__.co_names),
        "EngramLayout",
    )
    VLLM.expect(
        params(engram.can_share_engram_tables) == ["layout", "block_size"],
        "can_share_engram_tables",
    )
    VLLM.expect(
        callable(getattr(engram, "get_engram_dp_size", None))
        and callable(getattr(engram, "get_engram_dp_group", None)),
        "Engram DP group",
    )


def check_ple_seams(ngram_embedding: ModuleType) -> None:
    """Qwen4Exp's PLE table in pinned host memory, as qwen4exp.py uses it."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    table = getattr(ngram_embedding, "Qwen4ExpPLEPinnedHostEmbedding", None)
    VLLM.expect(table is not None, "Qwen4Exp PLE module")
    assert table is not None
    VLLM.expect(
        params(table.allocate_embedding_weight)
        == ["self", "num_embeddings", "embedding_dim", "dtype"],
        "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight",
    )
    VLLM.expect(
        {"_uva_weight", "get_accelerator_view_from_cpu_tensor", "weight"}
        <= set(table.__init__.__code__.co_names)
        and callable(getattr(ngram_embedding, "get_accelerator_view_from_cpu_tensor", None)),
        "Qwen4ExpPLEPinnedHostEmbedding's UVA view",
    )
    base = vpe.VocabParallelEmbedding
    split = ["vocab_size_padded", "org_vocab_size_padded", "vocab_size", "org_vocab_size"]
    VLLM.expect(
        {"shard_indices", "padding_size", "tp_rank", "tp_size", "prefix"}
        <= set(base.__init__.__code__.co_names)
        and params(base._get_indices) == [*split, "tp_rank", "tp_size"]
        and callable(getattr(vpe, "pad_vocab_size", None)),
        "VocabParallelEmbedding's vocab split",
    )
    nvfp4 = getattr(ngram_embedding, "Qwen4ExpPLENvFp4EmbeddingMethod", None)
    VLLM.expect(
        nvfp4 is not None and "_uva_weight_scale" in nvfp4.create_weights.__code__.co_names,
        "Qwen4ExpPLENvFp4EmbeddingMethod",
    )
    check_ple_lookup_seams(ngram_embedding)


def check_ple_lookup_seams(ngram_embedding: ModuleType) -> None:
    """What rows read on the host each step rely on (ple_rows.py, ENGRAMD_DISK_OFFLOAD): the
    one lookup both entry points call, the lookup dtype, the ETP rank's vocab range, NVFP4's
    decode."""
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as nvfp4

    table = ngram_embedding.Qwen4ExpPLEPinnedHostEmbedding
    VLLM.expect(
        params(table._lookup) == ["self", "input_ids", "output"]
        and "_lookup" in table.sync_lookup.__code__.co_names
        and "_lookup"
        in getattr(table.start_prefetch, "__wrapped__", table.start_prefetch).__code__.co_names,
        "Qwen4ExpPLEPinnedHostEmbedding._lookup",
    )
    method = ngram_embedding.Qwen4ExpPLEEmbeddingMethod
    VLLM.expect(
        params(method.lookup_dtype) == ["self", "layer"]
        and "org_vocab_end_index" in method.lookup_from_pinned.__code__.co_names,
        "Qwen4ExpPLEEmbeddingMethod's lookup",
    )
    VLLM.expect(
        params(nvfp4.dequantize_to_dtype)[:4]
        == ["tensor_fp4", "tensor_sf", "global_scale", "dtype"]
        and "swizzle" in params(nvfp4.dequantize_to_dtype),
        "nvfp4_emulation_utils.dequantize_to_dtype",
    )


def check_step_seams(gpu_worker: ModuleType) -> None:
    """Where vLLM starts a step on every rank: its Worker's execute_model (a step with work or
    none) and execute_dummy_batch (an idle data-parallel rank's step)."""
    worker: Any = getattr(gpu_worker, "Worker", None)
    VLLM.expect(worker is not None, "GPU worker module")
    model_step = params(worker.execute_model)
    VLLM.expect(model_step == ["self", "scheduler_output"], "Worker.execute_model")
    VLLM.expect(params(worker.execute_dummy_batch) == ["self"], "Worker.execute_dummy_batch")
