"""Where table sets live: one module per backing, registered here by name."""

from __future__ import annotations

from .base import Backing, StagedSet, Usage
from .tmpfs import TmpfsBacking

#: Every backing by its name (`--backing`, status, metrics).
BACKINGS: dict[str, type[Backing]] = {TmpfsBacking.name: TmpfsBacking}

__all__ = ["BACKINGS", "Backing", "StagedSet", "TmpfsBacking", "Usage"]
