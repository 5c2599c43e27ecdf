"""Where table sets live: one module per backing, registered here by name."""

from __future__ import annotations

from ..config import DaemonConfig
from ..fdstore import FdStore
from ..shmfs import mount_of
from .base import Backing, StagedSet, Usage
from .hugetlbfs import HugetlbfsBacking
from .memfd import MemfdBacking
from .tmpfs import TmpfsBacking

#: Every backing by its name (`--backing`, status, metrics).
BACKINGS: dict[str, type[Backing]] = {
    b.name: b for b in (TmpfsBacking, HugetlbfsBacking, MemfdBacking)
}

#: `--backing` values beyond BACKINGS: several backings, tried in order per set.
COMBINED: dict[str, tuple[str, ...]] = {
    # tmpfs when the shm folder can hold the set, else memfd when memory can.
    "auto": (TmpfsBacking.name, MemfdBacking.name),
}


def backings_for(config: DaemonConfig, gid: int | None, fd_store: FdStore) -> list[Backing]:
    """The backings `config.backing` names, in order of preference.

    A shm folder on hugetlbfs is detected by its filesystem: "tmpfs" there
    means the hugetlbfs backing (same layout and semantics, packed).
    """
    names = COMBINED.get(config.backing, (config.backing,))
    on_hugetlbfs = mount_of(config.shm_dir)[0] == HugetlbfsBacking.name
    return [
        BACKINGS[
            HugetlbfsBacking.name if name == TmpfsBacking.name and on_hugetlbfs else name
        ].from_config(config, gid, fd_store)
        for name in names
    ]


__all__ = [
    "BACKINGS",
    "COMBINED",
    "Backing",
    "HugetlbfsBacking",
    "MemfdBacking",
    "StagedSet",
    "TmpfsBacking",
    "Usage",
    "backings_for",
]
