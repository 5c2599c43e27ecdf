"""engramd_client: attach a worker to the node's shared Engram tables, or fall back.

    from engramd_client import attach, ShareError

    tables = attach("/models/ckpt", labels={"dp_rank": "0"})
    tables.mode            # "shared" or "private"
    tables["layers.1.engram.embed.weight"]

This package never imports the daemon (engramd). The daemon imports it for
the layout, the checkpoint reader and the wire stubs, so `attach` and
`Tables` (which need torch) are imported on first use: the daemon never
loads torch.
"""

from typing import TYPE_CHECKING, Any

from .checkpoint import DEFAULT_TENSORS, TablePlan, plan_tables
from .config import ClientConfig
from .errors import (
    CheckpointError,
    DaemonError,
    DaemonUnavailable,
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
    from .share import attach
    from .tables import Tables

__all__ = [
    "DEFAULT_TENSORS",
    "CheckpointError",
    "ClientConfig",
    "DaemonError",
    "DaemonUnavailable",
    "EngramdError",
    "FingerprintMismatch",
    "NotAllowed",
    "SegmentNotVisible",
    "SelectionRefused",
    "ShareError",
    "ShmCapacityError",
    "TablePlan",
    "Tables",
    "UnknownSet",
    "attach",
    "plan_tables",
]


def __getattr__(name: str) -> Any:
    if name == "attach":
        from .share import attach

        return attach
    if name == "Tables":
        from .tables import Tables

        return Tables
    raise AttributeError(f"module 'engramd_client' has no attribute {name!r}")
