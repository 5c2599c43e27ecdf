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
- `Qwen4ExpPLEPinnedHostEmbedding._lookup` (replaced for layers whose rows
  are read on the host each step, ENGRAMD_DISK_OFFLOAD: the daemon's disk
  copy, or the checkpoint's own files without a daemon; ple_rows.py): what
  both of its entry points, `start_prefetch` and `sync_lookup`, call.

Each process decides alone: a PLE table's rows are the same bytes whichever
way a rank holds them, and allocating them involves no collective.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engramd_client.cuda import ROUTES, device_caps, parse_device
from engramd_client.engines.common import (
    Pattern,
    UnknownEngine,
    attach_rows,
    check_described,
    replaced,
    say_once,
    share_mode,
)
from engramd_client.engines.vllm import ple_rows
from engramd_client.engines.vllm.guard import check_ple_seams
from engramd_client.engines.vllm.process import (
    PROCESS,
    SERVED_MARK,
    checkpoint_folder,
    cuda_device,
    engine_path,
    log,
    tp_labels,
)
from engramd_client.rowread import HostRows
from engramd_client.share import backing_of, describe
from engramd_client.tables import Tables
from engramd_shared.checkpoint import plan_tables
from engramd_shared.config import ClientConfig
from engramd_shared.errors import CheckpointError, ShareError
from engramd_shared.families import PLE
from engramd_shared.pb import engramd_pb2 as pb

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
#: Tables whose rows are read on the host and staged: by the data_ptr of their CPU view, an
#: empty tensor on the device, which vLLM's prefetch takes its device from (no kernel reads it).
_staged: dict[int, torch.Tensor] = {}


@dataclass
class _HostRead:
    """This process's choice of where its layers' PLE rows are read each step."""

    #: The daemon's set is read on the host (its disk copy, or ENGRAMD_DISK_OFFLOAD=on).
    daemon: bool = False
    #: The device reads the mappings through the host's page tables (no staging).
    pageable: bool = False
    #: No daemon and ENGRAMD_DISK_OFFLOAD=on: the checkpoint's own files.
    checkpoint: ple_rows.CheckpointRows | None = None


_HOST = _HostRead()


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
    calls.replace(module.Qwen4ExpPLEPinnedHostEmbedding, "_lookup", _lookup)
    log.debug("engramd's vLLM plugin serves Qwen4Exp PLE n-gram tables")


def _allocate(self: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> Any:
    assert PROCESS.pattern is not None
    if torch.get_default_device().type == "meta":
        return PROCESS.calls.call(_allocate, self, num_embeddings, embedding_dim, dtype)
    if not PROCESS.decide(PLE, engine_tables=_EngineTables(PROCESS.pattern), instead=_instead):
        if _HOST.checkpoint is not None:
            return _from_checkpoint(self, _HOST.checkpoint, num_embeddings, embedding_dim, dtype)
        return PROCESS.calls.call(_allocate, self, num_embeddings, embedding_dim, dtype)
    tables = PROCESS.tables or _attach(self)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tables.items()}
    name = _table_of(self, shapes, embedding_dim, dtype)
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
    part = name.rpartition(".")[2]
    setattr(self, SERVED_MARK, (*getattr(self, SERVED_MARK, ()), part))
    if _HOST.daemon:
        ple_rows.attach_host_table(
            self, part, HostRows.of_tensor(table, first_row=start), _HOST.pageable
        )
    if tables.device is not None:
        view = tables.cuda(name)
        _views[table.data_ptr()] = view
        if name.endswith(".weight_scale"):
            # NVFP4 takes its scales' view only from memory torch calls pinned.
            self.quant_method._uva_weight_scale = view
    elif _HOST.daemon and torch.cuda.is_available():
        _staged[table.data_ptr()] = torch.empty(0, dtype=dtype, device=cuda_device())
    return table


def _from_checkpoint(
    layer: Any,
    found: ple_rows.CheckpointRows,
    num_embeddings: int,
    embedding_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """No daemon and ENGRAMD_DISK_OFFLOAD=on: the layer's rows read from the checkpoint's files."""
    shapes = found.torch_shapes()
    name = _table_of(layer, shapes, embedding_dim, dtype, where=PROCESS.folder or "the checkpoint")
    start, stop = _range(layer, shapes[name][0][0])
    if stop - start != num_embeddings:
        raise CheckpointError(
            f"{name} gives {stop - start} rows to ETP rank {layer.tp_rank} where vLLM's layer "
            f"{layer.prefix} holds {num_embeddings}: the checkpoint does not match the model's "
            "config"
        )
    part = name.rpartition(".")[2]
    setattr(layer, SERVED_MARK, (*getattr(layer, SERVED_MARK, ()), part))
    PROCESS.served = PROCESS.served | found.names
    ple_rows.attach_host_table(layer, part, found.tables[name], pageable=False)
    weight = ple_rows.placeholder(num_embeddings, embedding_dim, dtype)
    if torch.cuda.is_available():
        _staged[weight.data_ptr()] = torch.empty(0, dtype=dtype, device=cuda_device())
    return weight


def _instead(config: Any) -> str:
    """What runs where engramd does not serve: with ENGRAMD_DISK_OFFLOAD=on, the checkpoint's
    own files read the same way where their layout allows, else vLLM's pinned tables."""
    if ClientConfig.from_env().disk_offload is not True:
        return engine_path(PLE)
    try:
        folder = checkpoint_folder(config)
        PROCESS.folder = folder
        _HOST.checkpoint = ple_rows.checkpoint_rows(folder)
    except (CheckpointError, ShareError, OSError, ValueError) as e:
        return (
            f"ENGRAMD_DISK_OFFLOAD=on cannot read the PLE rows from the checkpoint's files "
            f"({e}), so vLLM allocates its own PLE tables: {_pinned_memory(config)}"
        )
    total = sum(rows.nbytes for rows in _HOST.checkpoint.tables.values())
    return (
        f"each step's PLE rows are read on the host from {folder}'s own files "
        f"(ENGRAMD_DISK_OFFLOAD=on; {total / 2**30:.2f} GiB of tables, none allocated, the "
        "page cache holds what is read)"
    )


def _pinned_memory(config: Any) -> str:
    """The memory vLLM's own PLE tables take in this process, as far as the headers say."""
    etp = config.engram_config.get_parallel_size(config.parallel_config)
    try:
        plan = plan_tables(checkpoint_folder(config), PLE.selection)
    except (CheckpointError, ShareError, OSError, ValueError):
        return f"pinned host memory of this process for 1/{etp} of every PLE table"
    return (
        f"{plan.nbytes / etp / 2**30:.2f} GiB of pinned host memory in this process (the PLE "
        f"tables' {plan.nbytes / 2**30:.2f} GiB over {etp} ETP rank(s))"
    )


def _lookup(self: Any, input_ids: torch.Tensor, output: torch.Tensor | None = None) -> Any:
    host = getattr(self, ple_rows.HOST_TABLE, None)
    if host is None:
        return PROCESS.calls.call(_lookup, self, input_ids, output)
    if host.pageable:
        ple_rows.fault_in(self, input_ids)
        return PROCESS.calls.call(_lookup, self, input_ids, output)
    return ple_rows.lookup(self, input_ids, output)


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


def _table_of(
    layer: Any,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    width: int,
    dtype: torch.dtype,
    where: str = "",
) -> str:
    """The table `layer` allocates now, of `shapes` (name: shape, dtype): its layer's, of this
    width and dtype."""
    match = _TABLE.search(layer.prefix)
    for name, (shape, held) in shapes.items():
        tail = _TABLE.search(name.rpartition(".")[0])
        if (
            match is not None
            and tail is not None
            and tail[1] == match[1]
            and shape[1:] == (width,)
            and held == dtype
        ):
            return name
    raise CheckpointError(
        f"{where or PROCESS.folder} holds no PLE table for vLLM's layer {layer.prefix} of width "
        f"{width} and dtype {dtype} (it holds {sorted(shapes)[:4]}): the checkpoint does "
        "not match the model's config"
    )


def _attach(layer: Any) -> Tables:
    """Every PLE table's rows for this process's ETP rank, attached once."""
    described = describe(PROCESS.folder, tensors=PLE.selection)
    PROCESS.rows = {t.name: _range(layer, t.shape[0]) for t in described}
    device = cuda_device()
    _HOST.daemon = bool(described) and _reads_on_host(described[0].set_id)
    tables = attach_rows(
        PROCESS.folder,
        PROCESS.rows,
        # Strict after the decision: engramd's own private copy of exact rows stands in.
        strict=True if share_mode() else None,
        # Rows read on the host are registered with no device: that would pin the table.
        device=None if _HOST.daemon else device,
        labels={**tp_labels(), "etp_rank": str(layer.tp_rank)},
        selection=PLE.selection,
        pad_rows=True,
    )
    check_described(tables, described, PROCESS.folder)
    index = parse_device(device or "")
    if _HOST.daemon and index is not None and device_caps(index).host_page_tables:
        # The device reads the mapping where it is; CPU threads fault each step's rows in.
        tables.register_on(index, ROUTES[pb.GPU_ROUTE_HOST_PAGE_TABLES])
        _HOST.pageable = True
    if _HOST.daemon:
        log.info(
            "engramd: vLLM's PLE rows are read each step on the host from the daemon's file "
            "(ENGRAMD_DISK_OFFLOAD; %s), no table allocated",
            "the device reads the mapping" if _HOST.pageable else "pinned staging",
        )
    return PROCESS.hold(tables, PLE.tables)


def _reads_on_host(set_id: str) -> bool:
    """ENGRAMD_DISK_OFFLOAD: on, off, or (auto) whether the daemon keeps the set on disk."""
    chosen = ClientConfig.from_env().disk_offload
    if chosen is not None:
        return chosen
    try:
        return backing_of(set_id) == "disk"
    except ShareError as e:
        say_once(log, logging.WARNING, "backing", "engramd: the set's backing is unknown (%s)", e)
        return False


def _accelerator_view(cpu_tensor: torch.Tensor) -> torch.Tensor:
    staged = _staged.get(cpu_tensor.data_ptr())
    if staged is not None:
        return staged
    view = _views.get(cpu_tensor.data_ptr())
    if view is not None and tuple(view.shape) == tuple(cpu_tensor.shape):
        return view
    return PROCESS.calls.call(_accelerator_view, cpu_tensor)
