"""DeepSeek-V4.1's CPU-offloaded Engram tables in vLLM, from engramd.

Each layer's `weight` and `weight_scale_inv` are read-only views of exactly
the rows vLLM computed for the rank (its ceil-division head split), the GPU
reads them through engramd's CUDA views, and no replica reads the tables
from the checkpoint. Tables vLLM keeps in GPU memory are left alone.

The seams, in vLLM 0.33.0's `vllm.models.deepseek_v41.common.engram`:

- `Engram._create_embedding` (around): which layer a table belongs to.
- `ParallelEngramEmbedding._allocate_weights` (replaced where engramd
  serves): the daemon's rows instead of pinned, THP or /dev/shm memory; the
  layer's `_views` / `_view_src` take engramd's CUDA views.
- `can_share_engram_tables` (as the DeepSeek-V4.1 models import it): with
  data-parallel replicas, the Engram DP group's leader asks the daemon and
  broadcasts the answer, so every rank agrees; "shared" when engramd serves.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import (
    UnknownEngine,
    attach_rows,
    replaced,
    say_once,
    share_mode,
    table_names,
)
from engramd_client.engines.vllm.guard import check_engram_seams
from engramd_client.engines.vllm.process import (
    PROCESS,
    SERVED_MARK,
    cuda_device,
    log,
    served_weight_loader,
    tp_labels,
)
from engramd_client.sharding import ceil_head_rows
from engramd_client.tables import Tables
from engramd_shared.errors import CheckpointError
from engramd_shared.families import ENGRAM

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
#: The models that import `can_share_engram_tables` by name.
MODEL_MODULES = ("vllm.models.deepseek_v41.nvidia.model", "vllm.models.deepseek_v41.amd.model")

#: (layout, layer_hash_index) of the Engram layer whose table is being made.
_site: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "engramd_vllm_site", default=None
)


def install(engram: ModuleType) -> None:
    """Put the plugin's functions in vLLM's place, all of them or (on a surprise) none."""
    if replaced(engram.ParallelEngramEmbedding._allocate_weights):
        return
    try:
        check_engram_seams(engram)
        PROCESS.install_loader()
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    calls = PROCESS.calls
    calls.replace(engram.Engram, "_create_embedding", _create_embedding)
    calls.replace(engram.ParallelEngramEmbedding, "_allocate_weights", _allocate_weights)
    original = calls.replace(engram, "can_share_engram_tables", _can_share_engram_tables)
    for name in MODEL_MODULES:
        # Models imported before the plugin hold vLLM's function under their own name.
        model = sys.modules.get(name)
        if model is not None and getattr(model, "can_share_engram_tables", None) is original:
            setattr(model, "can_share_engram_tables", engram.can_share_engram_tables)  # noqa: B010
    log.debug("engramd's vLLM plugin serves DeepSeek-V4.1 Engram tables")


def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
    token = _site.set((layout, layer_hash_index))
    try:
        return PROCESS.calls.call(_create_embedding, self, layout, layer_hash_index)
    finally:
        _site.reset(token)


def _can_share_engram_tables(layout: Any, block_size: int = 32) -> bool:
    from vllm.models.deepseek_v41.common import engram

    if engram.get_engram_dp_size() > 1:
        group = engram.get_engram_dp_group()
        # Every rank of the group calls this at the same point of model
        # construction, as vLLM's own check does; the leader's answer goes to all.
        if PROCESS.decide(
            ENGRAM, leader=group.rank_in_group == 0, broadcast=group.broadcast_object
        ):
            return True
    return bool(PROCESS.calls.call(_can_share_engram_tables, layout, block_size))


def layout_rows(layout: Any, head_rank: int, shards: int) -> dict[str, tuple[int, int]]:
    """Each Engram table's rows for head shard `head_rank` of `shards`, split as vLLM splits."""
    rows = {}
    for index, layer_id in enumerate(layout.layer_ids):
        heads = [size for order in layout.primes[index] for size in order]
        span = ceil_head_rows(heads, head_rank, shards)
        for name in table_names(layer_id):
            rows[name] = span
    return rows


def _attach(table: Any, layout: Any) -> Tables:
    shards, head_rank = table._get_shard_info()
    tables = attach_rows(
        PROCESS.folder,
        layout_rows(layout, head_rank, shards),
        # After the decision only engramd's own private copy may stand in: the
        # other ranks built their layers on engramd's answer.
        strict=True if share_mode() else None,
        device=cuda_device(),
        labels=tp_labels(),
        selection=ENGRAM.selection,
    )
    return PROCESS.hold(tables, ENGRAM.tables)


def _allocate_weights(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    site = _site.get()
    if (
        site is None
        or not self.cpu_offload
        or self.peer_rows
        or torch.get_default_device().type == "meta"
        or not PROCESS.decide(ENGRAM)
    ):
        return PROCESS.calls.call(_allocate_weights, self)
    layout, index = site
    tables = PROCESS.tables or _attach(self, layout)
    weight_name, scale_name = table_names(layout.layer_ids[index])
    weight = tables[weight_name]
    scale = tables[scale_name].view(torch.uint8)
    rows = self.vocab_end_idx - self.vocab_start_idx
    if (
        weight.dtype != torch.float8_e4m3fn
        or tuple(weight.shape) != (rows, self.dim)
        or tuple(scale.shape) != (rows, self.dim // self.block_size)
    ):
        raise CheckpointError(
            f"{weight_name} / {scale_name} of {PROCESS.folder} are {weight.dtype} "
            f"{tuple(weight.shape)} / {tuple(scale.shape)} for vLLM's rows "
            f"{self.vocab_start_idx}..{self.vocab_end_idx}; vLLM's layer wants float8_e4m3fn "
            f"[{rows}, {self.dim}] and [{rows}, {self.dim // self.block_size}] bytes: the "
            "checkpoint does not match the model's config"
        )
    # The pages are the daemon's and read-only: nothing may write them.
    self._weight_loader = served_weight_loader
    setattr(self, SERVED_MARK, ("weight", "weight_scale_inv"))
    if tables.device is not None:
        self._views = (tables.cuda(weight_name), tables.cuda(scale_name).view(torch.uint8))
        self._view_src = (weight.data_ptr(), scale.data_ptr())
    return weight, scale
