"""DeepSeek-V4.1's host-memory Engram tables in SGLang, from engramd.

It engages only where SGLang keeps the Engram tables in host memory
(`SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE`); by default SGLang keeps them in
GPU memory and nothing here is registered. With the daemon on the node,
each `EngramEmbedding`'s host table is the daemon's one copy: `weight` /
`scale` are read-only views of exactly the rows SGLang's `shard_range`
gives the TP rank (layout `per_rank`) or of the whole table (layout
`shared`), the GPU reads them through engramd's CUDA views, and SGLang's
weight loading reads none of them from the checkpoint. Unlike SGLang's own
`shared` layout (a memfd passed through /proc inside one server), the copy
is shared by every server and container on the node.

The hooks, all through SGLang's own HookRegistry, in SGLang 0.5.23:

- `Engram.__init__` (around): the layer's EngramLayout, so the first table
  attaches every layer's rows at once.
- `EngramEmbedding._init_host_table` (around; SGLang calls it only for host
  tables): the daemon's rows instead of SGLang's memfd or private memory.
- `EngramEmbedding._load_rows` (around): never writes a served table.

One decision per TP group: rank 0 asks the daemon and SGLang's TP group
broadcasts the answer (the `shared` layout's own setup is collective: ranks
that decided apart would hang).
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch

from engramd_client.engines.common import attach_rows, say_once, share_mode, table_names
from engramd_client.engines.sglang.process import PROCESS, log
from engramd_client.tables import Tables
from engramd_shared.errors import CheckpointError
from engramd_shared.families import ENGRAM

LAYOUTS = ("shared", "per_rank")
#: What SGLang does where engramd does not serve, for the one warning.
OWN_TABLES = "Engram host tables (as SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT says)"

ENGRAM_MODULE = "sglang.srt.layers.engram"

#: What SGLang's DeepseekV4 `load_weights` hands to `EngramEmbedding` (it only
#: prefixes `model.`): SGLang has no pattern of its own to compare with.
ENGRAM_TABLES = re.compile(r"(^|\.)layers\.\d+\.engram\.embed\.(weight|scale)$")

#: The EngramLayout of the Engram layer being built.
_layout: contextvars.ContextVar[Any] = contextvars.ContextVar("engramd_sglang_layout", default=None)


def seams() -> list[tuple[str, Callable[..., Any], str]]:
    """The hooks to register, (target, hook, HookType member name)."""
    table = f"{ENGRAM_MODULE}.EngramEmbedding"
    return [
        (f"{ENGRAM_MODULE}.Engram.__init__", _engram_init, "AROUND"),
        (f"{table}._init_host_table", _init_host_table, "AROUND"),
        (f"{table}._load_rows", _load_rows, "AROUND"),
    ]


def _decide() -> bool:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # Every rank builds its first Engram layer at the same point; the leader's answer
    # reaches all of them, so the shared layout's collectives cannot split.
    group = parallel.tp_group if parallel.tp_size > 1 else None
    return PROCESS.decide(ENGRAM, ENGRAM_TABLES, OWN_TABLES, group)


def _engram_init(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    layout = args[2] if len(args) > 2 else kwargs.get("layout")
    token = _layout.set(layout)
    try:
        return original(self, *args, **kwargs)
    finally:
        _layout.reset(token)


def layout_rows(layout: Any, tp_rank: int, tp_size: int) -> dict[str, tuple[int, int]]:
    """Each Engram table's rows for TP rank `tp_rank` of `tp_size`, as SGLang's shard_range says."""
    from sglang.srt.layers.engram import shard_range

    rows = {}
    for index, layer_id in enumerate(layout.layer_ids):
        span = shard_range(
            layout.num_embeddings[index], layout.column_bounds(index), tp_rank, tp_size
        )
        for name in table_names(layer_id):
            rows[name] = span
    return rows


def _attach(layout: Any, host_layout: str) -> Tables:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    device = None
    if torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    strict = share_mode()
    tables = attach_rows(
        PROCESS.folder,
        # shared: every rank maps the whole table, as SGLang's shared layout does.
        layout_rows(layout, parallel.tp_rank, parallel.tp_size)
        if host_layout == "per_rank"
        else None,
        # After the group's decision only engramd's own private copy may stand in:
        # the other ranks built their layers on engramd's answer.
        strict=True if strict else None,
        device=device,
        labels={
            "engine": "sglang",
            "engine_version": version("sglang"),
            "tp_rank": str(parallel.tp_rank),
            "layout": host_layout,
        },
        selection=ENGRAM.selection,
    )
    # SGLang's weight loading skips exactly what this process maps.
    return PROCESS.hold(tables, f"Engram tables ({host_layout} layout)")


class ServedTable:
    """Stands where SGLang's `_HostTable` stands for a served layer.

    SGLang reads `layout` (whether the lookup covers the whole table), sets
    `dirty` in `_load_rows` and calls `finish_load` after loading; the
    daemon's table needs no barrier, no huge-page collapse and no cache drop.
    """

    def __init__(self, layout: str, nbytes: int, device_ptr: int) -> None:
        self.layout = layout
        self.nbytes = nbytes
        self.device_ptr = device_ptr
        self.dirty = False

    def finish_load(self, label: str) -> None:
        """Nothing to finish: the daemon loaded the table."""


def _init_host_table(
    original: Callable[..., Any], self: Any, num_embeddings: int, dim: int, layer_id: int
) -> None:
    from sglang.srt.environ import envs

    layout = _layout.get()
    host_layout = envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get()
    if layout is None or host_layout not in LAYOUTS or not _decide():
        # An EngramEmbedding built outside an Engram layer, or a layout SGLang refuses itself.
        return original(self, num_embeddings, dim, layer_id)
    tables = PROCESS.tables or _attach(layout, host_layout)
    import sglang.srt.layers.engram as engram

    weight_name, scale_name = table_names(layer_id)
    weight = tables[weight_name]
    scale = tables[scale_name].view(torch.uint8)
    rows = num_embeddings if host_layout == "shared" else self.rows
    block = engram.FP8_BLOCK_SIZE
    if (
        weight.dtype != torch.float8_e4m3fn
        or tuple(weight.shape) != (rows, dim)
        or tuple(scale.shape) != (rows, dim // block)
    ):
        raise CheckpointError(
            f"{weight_name} / {scale_name} of {PROCESS.folder} are {weight.dtype} "
            f"{tuple(weight.shape)} / {tuple(scale.shape)} for SGLang's rows of layer "
            f"{layer_id}; SGLang's layer wants float8_e4m3fn [{rows}, {dim}] and "
            f"[{rows}, {dim // block}] bytes: the checkpoint does not match the model's config"
        )
    scale = scale.view(torch.float8_e8m0fnu)
    self.weight = torch.nn.Parameter(weight, requires_grad=False)
    self.scale = torch.nn.Parameter(scale, requires_grad=False)
    # SGLang's lookup kernel reads through these raw addresses (of the table's first
    # row here: SGLang's row 0 in the shared layout, its row_start per rank).
    if tables.device is not None:
        pointers = (tables.cuda(weight_name).data_ptr(), tables.cuda(scale_name).data_ptr())
    else:
        pointers = (weight.data_ptr(), scale.data_ptr())
    self._host_table_ptrs = pointers
    nbytes = weight.numel() + scale.numel()
    self.host_table = ServedTable(host_layout, nbytes, pointers[0])
    self._sort_host_reads = engram._sorted_host_reads(torch.cuda.current_device())
    self._engramd_served = True


def _load_rows(original: Callable[..., Any], self: Any, param: Any, loaded_weight: Any) -> None:
    if not getattr(self, "_engramd_served", False):
        return original(self, param, loaded_weight)
    if loaded_weight.device.type != "meta":
        # A load format or weight update that read the table anyway: the layer keeps
        # the daemon's copy (its pages are read-only).
        say_once(
            log,
            logging.WARNING,
            "read",
            "SGLang read an Engram table engramd serves from the checkpoint; the layer keeps "
            "engramd's copy (a weight update of the Engram tables needs the daemon to load "
            "the new checkpoint)",
        )
    return None
