"""Where table sets live: one module per backing, registered here by name."""

from __future__ import annotations

from ..config import DaemonConfig
from ..fdstore import FdStore
from .base import Backing, StagedSet, Usage
from .memfd import MemfdBacking
from .tmpfs import TmpfsBacking

#: Every backing by its name (`--backing`, status, metrics).
BACKINGS: dict[str, type[Backing]] = {b.name: b for b in (TmpfsBacking, MemfdBacking)}

#: `--backing` values beyond BACKINGS: several backings, tried in order per set.
COMBINED: dict[str, tuple[str, ...]] = {
    # tmpfs when the shm folder can hold the set, else memfd when memory can.
    "auto": (TmpfsBacking.name, MemfdBacking.name),
}


def backings_for(config: DaemonConfig, gid: int | None, fd_store: FdStore) -> list[Backing]:
    """The backings `config.backing` names, in order of preference."""
    names = COMBINED.get(config.backing, (config.backing,))
    return [BACKINGS[name].from_config(config, gid, fd_store) for name in names]


__all__ = [
    "BACKINGS",
    "COMBINED",
    "Backing",
    "MemfdBacking",
    "StagedSet",
    "TmpfsBacking",
    "Usage",
    "backings_for",
]
