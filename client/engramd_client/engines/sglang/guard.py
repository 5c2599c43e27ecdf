"""The SGLang plugin's compatibility guard: the version and every seam the hooks rely on.

SGLang's HookRegistry only logs a hook it cannot apply, so the plugin checks
every target, signature and attribute here before it registers any: an
SGLang whose seams differ gets one warning and no hook.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from engramd_client.engines.common import SERVED_LOAD_FORMATS, Engine, params

#: SGLang as the guard names it, with the versions whose seams this plugin was written
#: against and tested with.
SGLANG = Engine("SGLang", frozenset({"0.5.23"}), SERVED_LOAD_FORMATS | {"runai_streamer"})


def sglang_version() -> str:
    """The running SGLang's version (`sglang.version.__version__`)."""
    from sglang import version

    return str(version.__version__)


def _names(function: Any) -> set[str]:
    code = getattr(function, "__code__", None) or function.fget.__code__
    return set(code.co_names)


def check_seams(
    engram: ModuleType, weight_utils: ModuleType, registry: ModuleType, envs: Any
) -> None:
    """Raise UnknownEngine unless every signature and attribute the plugin relies on is there."""
    table = getattr(engram, "EngramEmbedding", None)
    layer = getattr(engram, "Engram", None)
    SGLANG.expect(table is not None and layer is not None, "Engram module")
    assert table is not None and layer is not None
    SGLANG.expect(params(layer.__init__)[:4] == ["self", "config", "layer_id", "layout"], "Engram")
    SGLANG.expect(
        params(table._init_host_table) == ["self", "num_embeddings", "dim", "layer_id"]
        and params(table._load_rows) == ["self", "param", "loaded_weight"],
        "EngramEmbedding methods",
    )
    needed = {"row_start", "rows", "_init_host_table", "weight_loader", "_load_rows"}
    SGLANG.expect(needed <= _names(table.__init__), "EngramEmbedding attributes")
    SGLANG.expect(
        {"host_table", "_host_table_ptrs"} <= _names(table._table_ptrs)
        and {"host_table", "layout"} <= _names(table._shared)
        and {"host_table", "dirty"} <= _names(table._load_rows)
        and {"host_table", "finish_load"} <= _names(table.finish_load),
        "EngramEmbedding host-table use",
    )
    SGLANG.expect(
        params(engram.shard_range) == ["num_embeddings", "column_bounds", "tp_rank", "tp_size"]
        and callable(getattr(engram, "_sorted_host_reads", None))
        and callable(getattr(engram.EngramLayout, "column_bounds", None))
        and {"layer_ids", "num_embeddings"} <= set(engram.EngramLayout.__struct_fields__),
        "shard_range / EngramLayout",
    )
    options = ["disable_mmap", "prefetch", "prefetch_num_threads", "drop_cache_after_load"]
    SGLANG.expect(
        params(weight_utils.safetensors_weights_iterator) == ["hf_weights_files", *options]
        and params(weight_utils.buffered_multi_thread_safetensors_weights_iterator)
        == ["hf_weights_files", "max_workers", *options]
        and callable(getattr(weight_utils, "_drop_file_cache_after_load", None))
        and params(weight_utils.runai_safetensors_weights_iterator)
        == ["hf_weights_files", "is_distributed", "device"],
        "safetensors weight iterators",
    )
    hook_type = getattr(registry, "HookType", None)
    SGLANG.expect(
        hook_type is not None
        and {"AROUND", "REPLACE"} <= set(hook_type.__members__)
        and params(registry.HookRegistry.register)[:3] == ["target", "hook", "hook_type"],
        "HookRegistry",
    )
    SGLANG.expect(
        all(
            hasattr(envs, name)
            for name in (
                "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE",
                "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT",
            )
        ),
        "Engram settings (sglang.srt.environ)",
    )


def check_ple_seams(qwen4_exp: ModuleType, vocab: ModuleType) -> None:
    """Raise UnknownEngine unless Qwen4Exp's PLE host table is allocated as qwen4exp.py knows.

    `qwen4_exp`: sglang.srt.models.qwen4_exp; `vocab`: its VocabParallelEmbedding's module.
    """
    embedding = getattr(qwen4_exp, "Qwen4ExpNGramEmbedding", None)
    host = getattr(qwen4_exp, "Qwen4ExpPinnedHostEmbedding", None)
    allocate = getattr(qwen4_exp, "allocate_ple_host_table", None)
    SGLANG.expect(
        embedding is not None
        and host is not None
        and callable(allocate)
        and callable(getattr(qwen4_exp, "_use_attn_tp_ngram", None)),
        "Qwen4Exp PLE module",
    )
    assert embedding is not None and host is not None and allocate is not None
    SGLANG.expect(
        params(embedding.__init__)[:6]
        == ["self", "config", "embedding_dim", "ple_layer_index", "quant_config", "prefix"]
        and {"Qwen4ExpPinnedHostEmbedding", "VocabParallelEmbedding", "ple_offload_embedding"}
        <= _names(embedding.__init__),
        "Qwen4ExpNGramEmbedding",
    )
    SGLANG.expect(
        params(allocate) == ["shape", "dtype", "backend", "table_dir", "tag"], "the PLE allocator"
    )
    # The allocator is told the rank's vocab range only through its tag, rows{start}-{end}.
    SGLANG.expect(
        {"allocate_ple_host_table", "shard_indices", "org_vocab_start_index", "org_vocab_end_index"}
        <= _names(host.__init__)
        and "rows" in host.__init__.__code__.co_consts
        and {"weight", "data_ptr"} <= _names(host.gather),
        "Qwen4ExpPinnedHostEmbedding",
    )
    prefetcher = getattr(qwen4_exp, "make_ple_file_prefetcher", None)
    ple_table = sys.modules.get("sglang.srt.models.qwen4_exp_ple_table")
    pages = getattr(getattr(ple_table, "PleFilePrefetcher", None), "pages_for_rows", None)
    SGLANG.expect(
        callable(prefetcher)
        and params(prefetcher) == ["table"]
        and callable(pages)
        and params(pages) == ["row_ids", "row_bytes"]
        and isinstance(getattr(ple_table, "PLE_FILE_PREFETCH_MIN_ROWS", None), int)
        and {"_file_prefetcher", "enqueue"} <= _names(host.gather),
        "the PLE file prefetcher",
    )
    factory = getattr(qwen4_exp, "make_ple_file_rss_trimmer", None)
    trimmer = getattr(ple_table, "PleFileRssTrimmer", None)
    SGLANG.expect(
        callable(factory)
        and params(factory) == ["table"]
        and trimmer is not None
        and params(trimmer.__init__)[:5] == ["self", "addr", "nbytes", "budget_bytes", "interval_s"]
        and callable(getattr(trimmer, "start", None)),
        "the PLE file trimmer",
    )
    # Read by the served table's prefetcher and trimmer (qwen4exp._prefetcher, _trimmer).
    envs = getattr(sys.modules.get("sglang.srt.environ"), "envs", None)
    SGLANG.expect(
        all(
            callable(getattr(getattr(envs, f"SGLANG_QWEN4_PLE_FILE_{name}", None), "get", None))
            for name in ("PREFETCH", "RSS_BUDGET_GB", "RSS_INTERVAL_S")
        ),
        "SGLang's PLE file variables",
    )
    base = getattr(vocab, "VocabParallelEmbedding", None)
    SGLANG.expect(
        base is not None
        and params(base.__init__)[:3] == ["self", "num_embeddings", "embedding_dim"]
        and {"params_dtype", "use_attn_tp_group"} <= set(params(base.__init__))
        and {"shard_indices", "num_embeddings_per_partition"} <= _names(base.__init__),
        "VocabParallelEmbedding's vocab split",
    )


def check_step_seams(scheduler: ModuleType) -> None:
    """Where SGLang starts a step on every TP rank: its Scheduler's run_batch (generation,
    embedding, idle and split-prefill batches alike)."""
    owner: Any = getattr(scheduler, "Scheduler", None)
    SGLANG.expect(owner is not None, "scheduler module")
    SGLANG.expect(
        params(owner.run_batch) == ["self", "batch", "pp_proxy_tensors"], "Scheduler.run_batch"
    )
