"""How much memory the daemon may still take: the host's and its cgroup's limits.

memfd sets are bounded by memory, not by a tmpfs size: their pages are
charged to the daemon's memory cgroup (v2 `memory.max`, v1
`memory.limit_in_bytes`, the tightest of the cgroup and its ancestors) and
come out of the host's MemAvailable. cuda-host sets (pinned by the driver)
are judged against the same bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from engramd.units import gib
from engramd_shared.errors import ShmCapacityError

# cgroup v1 writes "no limit" as a huge page-aligned number.
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """What bounds the daemon's memory, in bytes."""

    #: The bound that is tightest, in words ("host memory", "cgroup /x memory.max").
    where: str
    total: int
    available: int


def memory_limit(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> MemoryLimit:
    """The daemon's memory bound: MemTotal / MemAvailable, tightened by its memory cgroup."""
    meminfo = _meminfo(Path(proc) / "meminfo")
    best = MemoryLimit("host memory (MemTotal)", meminfo["MemTotal"], meminfo["MemAvailable"])
    for where, limit, current in _cgroup_limits(Path(proc) / "self/cgroup", Path(cgroup_root)):
        available = min(best.available, max(limit - current, 0))
        if limit < best.total:
            best = MemoryLimit(where, limit, available)
        else:
            best = replace(best, available=available)
    return best


def check_memory(needed: int, what: str, reclaimable: int, fix: str) -> None:
    """Raise ShmCapacityError, naming the bound and `fix`, unless `needed` bytes fit in memory.

    `reclaimable` bytes count as available: sets the caller evicts first.
    """
    limit = memory_limit()
    if needed > limit.total:
        raise ShmCapacityError(
            f"{what} needs {gib(needed)} but the daemon may use {gib(limit.total)} of memory "
            f"in all ({limit.where}); {fix}"
        )
    if needed > limit.available + reclaimable:
        raise ShmCapacityError(
            f"{what} needs {gib(needed)} but only {gib(limit.available)} of memory is "
            f"available to the daemon ({limit.where}: {gib(limit.total)}); {fix}"
        )


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _cgroup_limits(self_cgroup: Path, root: Path) -> list[tuple[str, int, int]]:
    """(where, limit, usage) of the daemon's memory cgroup and each of its ancestors."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folder, limit_file, usage_file = root, "memory.max", "memory.current"
            if not (root / "cgroup.controllers").exists():
                folder = root / "unified"
        elif "memory" in controllers.split(","):
            folder = root / "memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        node = Path(path)
        while True:
            here = folder / str(node).lstrip("/")
            limit, usage = _read_int(here / limit_file), _read_int(here / usage_file)
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                found.append((f"cgroup {node} {limit_file}", limit, usage))
            if node == node.parent:
                break
            node = node.parent
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def page_size_of_memfd() -> int:
    """The page size of new memfds: 2 MiB where shmem uses huge pages for them, else 4 KiB."""
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return os.sysconf("SC_PAGE_SIZE")
    if "[always]" in enabled or "[within_size]" in enabled or "[force]" in enabled:
        return 2 << 20
    return os.sysconf("SC_PAGE_SIZE")
