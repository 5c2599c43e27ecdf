"""Qwen4Exp's PLE n-gram table in vLLM, from engramd.

With `EngramConfig.cpu_offload` (the default) vLLM keeps each PLE layer's
vocab range of the table (its ETP rank's, after padding the vocabulary to
`make_ngram_vocab_size_divisible_by`) in pinned host memory, and its
loader copies the overlapping rows of the checkpoint's row shards into it.
With the daemon on the node, that range is a read-only view of the
daemon's one copy of the layer's table, whose shards the daemon keeps back
to back (engramd_shared.checkpoint): DP replicas, TP ranks and
separate TP1 servers on a node map one copy, the GPU reads it through
engramd's CUDA views, and no rank reads the shards from the checkpoint.
Every embedding method of `Qwen4ExpPLEEmbeddingMethod` is served: bf16,
fp8 (its global `weight_scale` stays vLLM's, loaded as any parameter) and
NVFP4 (its block scales, `shard_N.weight_scale`, are a second row table
served like the weight; `weight_scale_2` stays vLLM's).

The seams, in vLLM 0.33.0's `vllm.models.qwen4_exp.common.ngram_embedding`:

- `Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight` (replaced
  where engramd serves): called by the embedding method's `create_weights`
  for `weight` (and NVFP4's `weight_scale`) on a layer whose `prefix`,
  `shard_indices`, `padding_size`, `tp_rank` and `tp_size` (the ETP group:
  TP, or TP x DP with `embedding_across_dp`) are set; `_get_indices` and
  `pad_vocab_size` (vLLM's) give every layer's range at the first call.
- `get_accelerator_view_from_cpu_tensor`, as that module imports it: the
  GPU view of a served table is engramd's CUDA view (`_uva_weight`, NVFP4's
  `_uva_weight_scale`).

Each process decides alone: a PLE table's rows are the same bytes whichever
way a rank holds them, and allocating them involves no collective.
"""

from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import (
    Pattern,
    UnknownEngine,
    attach_rows,
    check_described,
    replaced,
    say_once,
    share_mode,
)
from engramd_client.engines.vllm.guard import check_ple_seams
from engramd_client.engines.vllm.process import (
    PROCESS,
    SERVED_MARK,
    cuda_device,
    log,
    tp_labels,
)
from engramd_client.share import describe
from engramd_client.tables import Tables
from engramd_shared.errors import CheckpointError
from engramd_shared.families import PLE

PLE_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"

#: A PLE layer's table prefix in vLLM's module names and the checkpoint's alike
#: (`model.layers.K...` or `model.language_model.layers.K...`).
_TABLE = re.compile(r"(?:^|\.)(layers\.[0-9]+\.ple\.ple_embedding\.ngram_embedding)$")
#: NVFP4's block scales: a second row table, sharded like the weight, that vLLM's
#: `_ENGRAM_WEIGHT_RE` does not name but its PLE layer loads like the weight.
BLOCK_SCALES = re.compile(
    r"(?:^|\.)ple\.ple_embedding\.ngram_embedding\.shard_[0-9]+\.weight_scale$"
)


class _EngineTables:
    """The checkpoint names vLLM loads as PLE tables: its own pattern's and NVFP4's scales."""

    def __init__(self, pattern: Pattern) -> None:
        self._pattern = pattern

    def search(self, string: str, /) -> object:
        return self._pattern.search(string) or BLOCK_SCALES.search(string)


#: The served tables' CUDA views by the data_ptr of their CPU view.
_views: dict[int, torch.Tensor] = {}


def install(module: ModuleType) -> None:
    """Put the plugin's functions in vLLM's place, all of them or (on a surprise) none."""
    if replaced(module.Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight):
        return
    try:
        check_ple_seams(module)
        PROCESS.install_loader()
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    calls = PROCESS.calls
    calls.replace(module.Qwen4ExpPLEPinnedHostEmbedding, "allocate_embedding_weight", _allocate)
    calls.replace(module, "get_accelerator_view_from_cpu_tensor", _accelerator_view)
    log.debug("engramd's vLLM plugin serves Qwen4Exp PLE n-gram tables")


def _allocate(self: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> Any:
    assert PROCESS.pattern is not None
    if torch.get_default_device().type == "meta" or not PROCESS.decide(
        PLE, engine_tables=_EngineTables(PROCESS.pattern)
    ):
        return PROCESS.calls.call(_allocate, self, num_embeddings, embedding_dim, dtype)
    tables = PROCESS.tables or _attach(self)
    name = _table_of(self, tables, embedding_dim, dtype)
    table = tables[name]
    start = self.shard_indices.org_vocab_start_index
    if tuple(table.shape) != (num_embeddings, embedding_dim) or PROCESS.rows[name] != (
        start,
        start + num_embeddings,
    ):
        raise CheckpointError(
            f"{name} of {PROCESS.folder} gives rows {PROCESS.rows[name]} "
            f"({tuple(table.shape)}) where vLLM's layer {self.prefix} holds rows "
            f"{start}..{start + num_embeddings} of width {embedding_dim}: the checkpoint does "
            "not match the model's config"
        )
    setattr(self, SERVED_MARK, (*getattr(self, SERVED_MARK, ()), name.rpartition(".")[2]))
    if tables.device is not None:
        view = tables.cuda(name)
        _views[table.data_ptr()] = view
        if name.endswith(".weight_scale"):
            # NVFP4 takes its scales' view only from memory torch calls pinned.
            self.quant_method._uva_weight_scale = view
    return table


def _range(layer: Any, rows: int) -> tuple[int, int]:
    """Rows [start, stop) of a table of `rows` rows that `layer`'s ETP rank holds.

    As vLLM splits: the vocabulary padded to the layer's `padding_size`,
    split evenly over the ETP group; rows past the checkpoint's (already
    padded) table are padding, zeros.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

    padded = pad_vocab_size(rows, layer.padding_size)
    indices = layer._get_indices(padded, padded, rows, rows, layer.tp_rank, layer.tp_size)
    start = indices.org_vocab_start_index
    return start, start + padded // layer.tp_size


def _table_of(layer: Any, tables: Tables, width: int, dtype: torch.dtype) -> str:
    """The served table `layer` allocates now: its layer's, of this width and dtype."""
    match = _TABLE.search(layer.prefix)
    for name in tables:
        tail = _TABLE.search(name.rpartition(".")[0])
        if (
            match is not None
            and tail is not None
            and tail[1] == match[1]
            and tables[name].shape[1:] == (width,)
            and tables[name].dtype == dtype
        ):
            return name
    raise CheckpointError(
        f"{PROCESS.folder} holds no PLE table for vLLM's layer {layer.prefix} of width "
        f"{width} and dtype {dtype} (engramd holds {sorted(tables)[:4]}): the checkpoint does "
        "not match the model's config"
    )


def _attach(layer: Any) -> Tables:
    """Every PLE table's rows for this process's ETP rank, attached once."""
    described = describe(PROCESS.folder, tensors=PLE.selection)
    PROCESS.rows = {t.name: _range(layer, t.shape[0]) for t in described}
    tables = attach_rows(
        PROCESS.folder,
        PROCESS.rows,
        # Strict after the decision: engramd's own private copy of exact rows stands in.
        strict=True if share_mode() else None,
        device=cuda_device(),
        labels={**tp_labels(), "etp_rank": str(layer.tp_rank)},
        selection=PLE.selection,
        pad_rows=True,
    )
    check_described(tables, described, PROCESS.folder)
    return PROCESS.hold(tables, PLE.tables)


def _accelerator_view(cpu_tensor: torch.Tensor) -> torch.Tensor:
    view = _views.get(cpu_tensor.data_ptr())
    if view is not None and tuple(view.shape) == tuple(cpu_tensor.shape):
        return view
    return PROCESS.calls.call(_accelerator_view, cpu_tensor)
