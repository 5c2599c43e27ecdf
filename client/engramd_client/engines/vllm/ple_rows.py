"""Qwen4Exp's PLE rows read on the host each step (the seed's disk_offload), under vLLM 0.33.0.

A layer served this way allocates no table. Its `weight` (and NVFP4's
`weight_scale`) is a read-only view of the daemon's file over this ETP
rank's rows, or, without a daemon, a one-row placeholder while the rows are
read from the checkpoint's own shard files. vLLM's
`Qwen4ExpPLEPinnedHostEmbedding._lookup`, which both of its entry points
call (`start_prefetch`, on its side stream, and `sync_lookup`), reads the
step's rows of this rank with engramd_client.rowread, zeros for rows other
ETP ranks own (the reduce then sums each row's one owner: exact for fp8's
raw bytes), and puts them where vLLM's kernel would have:

- staging: the rows gathered into a pinned buffer and copied into vLLM's
  output on the stream the lookup runs on; NVFP4's packed rows and block
  scales both, decoded on the device by vLLM's own `dequantize_to_dtype`
  (its global `weight_scale_2` stays vLLM's parameter, as fp8's scale does);
- host page tables (a device whose pageable memory access uses the host's
  page tables, GB10-class: engramd_client.cuda's route): vLLM's own UVA
  kernel reads the mapping where it is (`_uva_weight` is the mapping's
  address on the device; nothing is registered or pinned) once CPU threads
  have faulted the step's rows in.

The lookup runs eagerly (vLLM's `eager_break_during_capture` on both entry
points), so reading on the host inside it is allowed under CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engramd_client.mapping import torch_dtype
from engramd_client.rowread import HostRows, RowReader
from engramd_shared.checkpoint import is_store_url, plan_tables
from engramd_shared.errors import CheckpointError
from engramd_shared.families import PLE

#: A layer whose rows are read on the host carries its HostTable under this name.
HOST_TABLE = "_engramd_host_rows"

#: vLLM's `_lookup`, called through where the device reads the mapping itself.
Lookup = Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class HostTable:
    """What one layer's lookups read: a reader per row table ("weight", NVFP4's
    "weight_scale"), and how the device gets the rows."""

    readers: dict[str, RowReader]
    #: The device reads the mapping through the host's page tables (vLLM's kernel runs).
    pageable: bool = False
    #: The last staging copy (a CUDA event): the staging buffers are reused after it.
    copied: Any = field(default=None, repr=False)


def attach_host_table(layer: Any, part: str, rows: HostRows, pageable: bool) -> None:
    """Read `layer`'s row table `part` from `rows` on the host: this ETP rank's vocab range."""
    indices = layer.shard_indices
    reader = RowReader(rows, indices.org_vocab_start_index, indices.org_vocab_end_index, pin=True)
    host = getattr(layer, HOST_TABLE, None)
    if host is None:
        host = HostTable({}, pageable)
        setattr(layer, HOST_TABLE, host)
    host.readers[part] = reader


def placeholder(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A table of `rows` rows that holds one: what a layer whose rows are read from the
    checkpoint's files keeps as its weight. A loader's copy into it fails (its rows alias)."""
    return torch.zeros(1, width, dtype=dtype).expand(rows, width)


def lookup(layer: Any, input_ids: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
    """vLLM's `_lookup` of a layer whose rows are read on the host (staging)."""
    host: HostTable = getattr(layer, HOST_TABLE)
    expected = (*input_ids.shape, layer.embedding_dim)
    dtype = layer.embedding_method.lookup_dtype(layer)
    if output is None:
        output = torch.empty(expected, dtype=dtype, device=input_ids.device)
    elif tuple(output.shape) != expected or output.dtype != dtype:
        raise ValueError(
            "PLE prefetch output must match the input shape, lookup dtype, and input device"
        )
    ids = host_ids(input_ids)
    n = ids.numel()
    if n == 0:
        return output
    if host.copied is not None:
        # The staging buffers of the last step are free once its copies ran.
        host.copied.synchronize()
    flat = output.view(n, -1)
    if "weight_scale" in host.readers:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            dequantize_to_dtype,
        )

        packed = _rows(host, "weight", ids, flat.device)
        scales = _rows(host, "weight_scale", ids, flat.device).view(torch.float8_e4m3fn)
        flat.copy_(
            dequantize_to_dtype(
                packed, scales, layer.weight_scale_2, layer.params_dtype, swizzle=False
            )
        )
    elif flat.device.type == "cpu":
        host.readers["weight"].gather(ids, out=flat)
    else:
        reader = host.readers["weight"]
        staged = reader.gather(ids, out=reader.staging(n))
        flat.view(torch.uint8).copy_(staged, non_blocking=True)
    if flat.device.type == "cuda":
        host.copied = torch.cuda.Event()
        host.copied.record()
    return output


def fault_in(layer: Any, input_ids: torch.Tensor) -> None:
    """Bring the step's rows of a layer the device reads through the host's page tables into
    memory, on CPU threads, before vLLM's kernel reads them."""
    host: HostTable = getattr(layer, HOST_TABLE)
    ids = host_ids(input_ids)
    for reader in host.readers.values():
        reader.fault_in(ids)


def host_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """The step's ids on the host (a copy from the device waits for them on its stream)."""
    return input_ids.reshape(-1).to("cpu").long()


def _rows(host: HostTable, part: str, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The rows of `part` for `ids` on `device` (through pinned staging to a GPU)."""
    reader = host.readers[part]
    if device.type == "cpu":
        return reader.gather(ids)
    staged = reader.gather(ids, out=reader.staging(ids.numel()))
    return staged.to(device, non_blocking=True)


@dataclass(frozen=True)
class CheckpointRows:
    """The PLE tables of a checkpoint folder, by name, read from its own files."""

    #: Each table's rows over read-only mappings of its shard files.
    tables: Mapping[str, HostRows]
    #: Each table's safetensors dtype and shape.
    shapes: Mapping[str, tuple[str, tuple[int, ...]]]
    #: The checkpoint's names of the tables' shards (vLLM's loader skips them).
    names: frozenset[str]

    def torch_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each table's shape and torch dtype."""
        return {n: (shape, torch_dtype(dtype)) for n, (dtype, shape) in self.shapes.items()}


def checkpoint_rows(folder: str) -> CheckpointRows:
    """Every PLE table of the checkpoint in `folder`, mapped where its row shards lie.

    Raises CheckpointError (or OSError) naming why its layout cannot be read
    this way: an object store's URL (no file on the node), tables whose row
    shards are not whole rows, files cut short.
    """
    if is_store_url(folder):
        raise CheckpointError(f"{folder} has no files on this node to read rows from")
    plan = plan_tables(Path(folder), PLE.selection)
    tables = {t.name: HostRows.of_entry(t) for t in plan.tensors}
    return CheckpointRows(
        tables,
        {t.name: (t.dtype, t.shape) for t in plan.tensors},
        frozenset(_names(plan.checkpoint_names.values())),
    )


def _names(groups: Iterable[tuple[str, ...]]) -> Iterable[str]:
    for group in groups:
        yield from group
