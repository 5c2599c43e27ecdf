"""Where table sets live: one module per backing, registered here by name."""

from __future__ import annotations

import logging
from dataclasses import replace

from engramd.backings.base import Backing, BackingUnavailable, StagedSet, Usage
from engramd.backings.cuda import CudaDeviceBacking, CudaHostBacking
from engramd.backings.hugetlbfs import HugetlbfsBacking
from engramd.backings.memfd import MemfdBacking
from engramd.backings.tmpfs import TmpfsBacking
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.shmfs import mount_of
from engramd.values import BackingSpec

#: Every backing by its name (`--backing`, status, metrics).
BACKINGS: dict[str, type[Backing]] = {
    b.name: b
    for b in (TmpfsBacking, HugetlbfsBacking, MemfdBacking, CudaHostBacking, CudaDeviceBacking)
}

log = logging.getLogger("engramd")

#: `--backing` values beyond BACKINGS: several backings, tried in order per set.
COMBINED: dict[str, tuple[str, ...]] = {
    # tmpfs when the shm folder can hold the set, else memfd when memory can.
    # Never a CUDA backing (explicit until it has been measured on GPUs).
    "auto": (TmpfsBacking.name, MemfdBacking.name),
}
#: What stands in for a backing that cannot work here: workers register their own mapping.
INSTEAD = "auto"


def backings_for(config: DaemonConfig, gid: int | None, fd_store: FdStore) -> list[Backing]:
    """The backings `config.backing` names, in order of preference.

    A shm folder on hugetlbfs is detected by its filesystem: "tmpfs" there
    means the hugetlbfs backing (same layout and semantics, packed). A
    backing that cannot work here (a CUDA backing without a usable driver or
    device) is replaced by auto's, each marked with what it stands in for and why.
    """
    combined = COMBINED.get(config.backing.name)
    specs = [BackingSpec(n) for n in combined] if combined else [config.backing]
    on_hugetlbfs = mount_of(config.shm_dir)[0] == HugetlbfsBacking.name
    backings: list[Backing] = []
    for spec in specs:
        kind = spec.name
        if kind == TmpfsBacking.name and on_hugetlbfs:
            kind = HugetlbfsBacking.name
        try:
            backings.append(BACKINGS[kind].from_config(config, gid, fd_store))
        except BackingUnavailable as e:
            instead = backings_for(replace(config, backing=BackingSpec(INSTEAD)), gid, fd_store)
            log.warning(
                "--backing %s cannot be used here (%s); sets go to %s instead, and workers "
                "with a device register their own mapping of them",
                spec,
                e.reason,
                "/".join(b.name for b in instead),
            )
            for b in instead:
                b.stands_in_for, b.reason = str(spec), e.reason
            backings.extend(instead)
    return backings


__all__ = [
    "BACKINGS",
    "COMBINED",
    "Backing",
    "BackingUnavailable",
    "CudaDeviceBacking",
    "CudaHostBacking",
    "HugetlbfsBacking",
    "MemfdBacking",
    "StagedSet",
    "TmpfsBacking",
    "Usage",
    "backings_for",
]
