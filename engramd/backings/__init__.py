"""Where table sets live: one module per backing, registered here by name.

A backing's module is imported when the backing is first named (BACKINGS,
or a class name such as `TmpfsBacking` read from this package): a daemon
imports only the backings it runs, not the CUDA ones' driver lookups and
copy helpers nor the huge-page pool's.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from engramd.backings.base import Backing, BackingUnavailable, StagedSet, Usage
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.shmfs import mount_of
from engramd.values import BackingSpec

if TYPE_CHECKING:
    from engramd.backings.cuda import CudaDeviceBacking, CudaHostBacking
    from engramd.backings.disk import DiskBacking
    from engramd.backings.hugetlbfs import HugetlbfsBacking
    from engramd.backings.memfd import MemfdBacking
    from engramd.backings.tmpfs import TmpfsBacking

#: Each backing's name (its class's `name`), module in this package and class.
_CLASSES: dict[str, tuple[str, str]] = {
    "tmpfs": ("tmpfs", "TmpfsBacking"),
    "hugetlbfs": ("hugetlbfs", "HugetlbfsBacking"),
    "memfd": ("memfd", "MemfdBacking"),
    "disk": ("disk", "DiskBacking"),
    "cuda-host": ("cuda", "CudaHostBacking"),
    "cuda-device": ("cuda", "CudaDeviceBacking"),
}


class _Registry(Mapping[str, type[Backing]]):
    """The backings by name; a backing's module is imported when it is looked up."""

    def __getitem__(self, name: str) -> type[Backing]:
        module, cls = _CLASSES[name]
        backing: type[Backing] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
        return backing

    def __iter__(self) -> Iterator[str]:
        return iter(_CLASSES)

    def __len__(self) -> int:
        return len(_CLASSES)


#: Every backing by its name (`--backing`, status, metrics).
BACKINGS: Mapping[str, type[Backing]] = _Registry()

log = logging.getLogger("engramd")

#: `--backing` values beyond BACKINGS: several backings, tried in order per set.
COMBINED: dict[str, tuple[str, ...]] = {
    # tmpfs when the shm folder can hold the set, else memfd when memory can.
    # Never a CUDA backing (explicit until it has been measured on GPUs).
    "auto": ("tmpfs", "memfd"),
}
#: What stands in for a backing that cannot work here: workers register their own mapping.
INSTEAD = "auto"


def _class_named(name: str) -> type[Backing]:
    """A backing's class by its class name, its module imported on first use."""
    for kind, (_, cls) in _CLASSES.items():
        if cls == name:
            return BACKINGS[kind]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not TYPE_CHECKING:
    # `from engramd.backings import TmpfsBacking` (PEP 562). Hidden from mypy, which
    # reads the classes' imports above and so still rejects a name that is no backing.
    __getattr__ = _class_named


def backings_for(config: DaemonConfig, gid: int | None, fd_store: FdStore) -> list[Backing]:
    """The backings `config.backing` names, in order of preference.

    A shm folder on hugetlbfs is detected by its filesystem: "tmpfs" there
    means the hugetlbfs backing (same layout and semantics, packed). A
    backing that cannot work here (a CUDA backing without a usable driver or
    device) is replaced by auto's, each marked with what it stands in for and why.
    """
    combined = COMBINED.get(config.backing.name)
    specs = [BackingSpec(n) for n in combined] if combined else [config.backing]
    on_hugetlbfs = mount_of(config.shm_dir)[0] == "hugetlbfs"
    backings: list[Backing] = []
    for spec in specs:
        kind = spec.name
        if kind == "tmpfs" and on_hugetlbfs:
            kind = "hugetlbfs"
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
    "DiskBacking",
    "HugetlbfsBacking",
    "MemfdBacking",
    "StagedSet",
    "TmpfsBacking",
    "Usage",
    "backings_for",
]
