"""The host's NUMA nodes and the node a worker runs on, from sysfs.

Nodes with memory are listed in /sys/devices/system/node/has_memory (a
range list such as "0-1"); the CPUs of node N in nodeN/cpulist. A worker's
node is the one holding most of the CPUs it may run on (its affinity): the
daemon's `--numa per-node` hands it the copy of the tables on that node.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

NODES = Path("/sys/devices/system/node")


def ranges(text: str) -> list[int]:
    """The numbers of a kernel range list: "0-2,4" -> [0, 1, 2, 4]."""
    found: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            found += range(int(first), int(last or first) + 1)
    return found


def nodes(root: Path = NODES) -> list[int]:
    """The NUMA nodes with memory (N_MEMORY; all online ones where the kernel does not say)."""
    for name in ("has_memory", "online"):
        try:
            return ranges((root / name).read_text())
        except OSError:
            continue
    return [0]


def local_node(root: Path = NODES, cpus: Iterable[int] | None = None) -> int | None:
    """The node with memory that holds most of `cpus` (this process's affinity); ties: the lowest.

    None where sysfs lists no node (a kernel without NUMA support).
    """
    allowed = set(os.sched_getaffinity(0) if cpus is None else cpus)
    votes: Counter[int] = Counter()
    for node in nodes(root):
        try:
            cpus_of_node = ranges((root / f"node{node}/cpulist").read_text())
        except OSError:
            continue
        votes[node] = len(allowed.intersection(cpus_of_node))
    if not votes:
        return None
    return min(votes, key=lambda n: (-votes[n], n))
