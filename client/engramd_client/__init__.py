"""engramd_client: attach a worker to the node's shared Engram tables, or fall back.

    from engramd_client import attach, ShareError

    tables = attach("/models/ckpt", labels={"dp_rank": "0"})
    tables.mode            # "shared" or "private"
    tables["layers.1.engram.embed.weight"]
    bind(model, tables, {"model.layers.1.engram.weight": "layers.1.engram.embed.weight"})

This package never imports the daemon (engramd). The daemon imports it for
the layout, the checkpoint reader and the wire stubs, so `attach`,
`Tables` and `bind` (which need torch) are imported on first use: the
daemon never loads torch.
"""

from typing import TYPE_CHECKING, Any

from engramd_client.sharding import ceil_head_rows, head_rows, head_rows_by_table
from engramd_shared.checkpoint import DEFAULT_TENSORS, TablePlan, plan_tables
from engramd_shared.config import ClientConfig
from engramd_shared.errors import (
    CheckpointError,
    DaemonError,
    DaemonUnavailable,
    DeviceError,
    EngramdError,
    FingerprintMismatch,
    NotAllowed,
    SegmentNotVisible,
    SelectionRefused,
    ShareError,
    ShmCapacityError,
    UnknownSet,
)

if TYPE_CHECKING:
    from engramd_client.binding import BindError, bind, layer_names
    from engramd_client.share import TableInfo, attach, describe
    from engramd_client.tables import Tables

__all__ = [
    "DEFAULT_TENSORS",
    "BindError",
    "CheckpointError",
    "ClientConfig",
    "DaemonError",
    "DaemonUnavailable",
    "DeviceError",
    "EngramdError",
    "FingerprintMismatch",
    "NotAllowed",
    "SegmentNotVisible",
    "SelectionRefused",
    "ShareError",
    "ShmCapacityError",
    "TableInfo",
    "TablePlan",
    "Tables",
    "UnknownSet",
    "attach",
    "bind",
    "ceil_head_rows",
    "describe",
    "head_rows",
    "head_rows_by_table",
    "layer_names",
    "plan_tables",
]


def __getattr__(name: str) -> Any:
    if name in ("attach", "describe", "TableInfo"):
        from engramd_client import share

        return getattr(share, name)
    if name == "Tables":
        from engramd_client.tables import Tables

        return Tables
    if name in ("bind", "layer_names", "BindError"):
        from engramd_client import binding

        return getattr(binding, name)
    raise AttributeError(f"module 'engramd_client' has no attribute {name!r}")
