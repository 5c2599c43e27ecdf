"""engramd_client: attach a worker to the node's shared Engram tables, or fall back.

    from engramd_client import attach, ShareError

    tables = attach("/models/ckpt", labels={"dp_rank": "0"})
    tables.mode            # "shared" or "private"
    tables["layers.1.engram.embed.weight"]

This package never imports the daemon (engramd); the daemon imports it for
the layout, the checkpoint reader and the wire stubs.
"""

from .attach import attach
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
    ShareError,
    ShmCapacityError,
    UnknownSet,
)
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
    "ShareError",
    "ShmCapacityError",
    "TablePlan",
    "Tables",
    "UnknownSet",
    "attach",
    "plan_tables",
]
