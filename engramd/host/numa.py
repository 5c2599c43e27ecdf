"""NUMA placement of a set's pages: the policy, the nodes, where pages ended up.

A set's pages are allocated when the loader reserves them (posix_fallocate
in the load thread), so the policy is the loading thread's memory policy,
set with set_mempolicy(2) around the reservation and reset after (the copy
then writes into pages that already exist). Python has no binding for it
and libnuma may be absent, so the syscall is made through ctypes. Where pages are is read back from
/proc/<pid>/numa_maps (N<node>=<pages> of each mapping).

Policies (`--numa`): "" leaves placement to the kernel (first touch);
"interleave" spreads pages over every node with memory; "node:N" binds them
to node N; "per-node" keeps one copy of a set per node, each bound to its
node, and hands a worker the copy of the node its CPUs are on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engramd_client.core.topology import NODES, nodes

MPOL_DEFAULT, MPOL_BIND, MPOL_INTERLEAVE = 0, 2, 3
# set_mempolicy(2) has no libc wrapper everywhere; its number per architecture.
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_libc = ctypes.CDLL(None, use_errno=True)
PER_NODE = "per-node"


class NumaError(ValueError):
    """A placement that cannot be made: names the nodes there are."""


@dataclass(frozen=True)
class Placement:
    """Where a set's pages go: "" (the kernel's choice), "interleave", "node:N" or "per-node"."""

    policy: str = ""
    #: The nodes with memory, as sysfs listed them when the placement was parsed.
    nodes: tuple[int, ...] = (0,)

    @classmethod
    def parse(cls, text: str, root: Path = NODES) -> Placement:
        """A placement from `--numa`, checked against the nodes with memory under `root`."""
        text, found = text.strip(), tuple(nodes(root))
        if text in ("", "interleave", PER_NODE):
            return cls(text, found)
        match = re.fullmatch(r"node:(\d+)", text)
        if not match:
            raise NumaError(
                f"--numa {text!r}: use interleave, node:N or {PER_NODE} (N one of {list(found)})"
            )
        if int(match.group(1)) not in found:
            raise NumaError(
                f"--numa {text}: node {match.group(1)} has no memory; nodes: {list(found)}"
            )
        return cls(text, found)

    @property
    def node(self) -> int | None:
        """The node a "node:N" placement binds pages to, else None."""
        return int(self.policy.split(":")[1]) if self.policy.startswith("node:") else None

    @property
    def copy_nodes(self) -> list[int | None]:
        """The node of each copy a set is kept as: every node per-node, else one copy (None)."""
        return list(self.nodes) if self.policy == PER_NODE else [None]

    def for_copy(self, node: int | None) -> Placement:
        """The placement of a set's copy for `node` (bound there); this one for None."""
        return self if node is None else Placement(f"node:{node}", self.nodes)

    def copy_node_for(self, worker_node: int | None) -> int | None:
        """The copy a worker on `worker_node` maps: its node's, else the first node's.

        None unless per-node: every worker then maps the one copy.
        """
        if self.policy != PER_NODE:
            return None
        return worker_node if worker_node in self.nodes else self.nodes[0]

    def mode_and_nodes(self) -> tuple[int, list[int]]:
        """The set_mempolicy mode and node list of this placement (per-node: the kernel's)."""
        if self.policy == "interleave":
            return MPOL_INTERLEAVE, list(self.nodes)
        if self.node is not None:
            return MPOL_BIND, [self.node]
        return MPOL_DEFAULT, []


def node_mask(node_ids: list[int]) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """The nodemask set_mempolicy(2) takes, and its maxnode argument."""
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = max(node_ids, default=0) // bits + 1
    mask = (ctypes.c_ulong * words)()
    for n in node_ids:
        mask[n // bits] |= 1 << (n % bits)
    return mask, words * bits + 1


@contextlib.contextmanager
def applied(placement: Placement) -> Iterator[None]:
    """This thread allocates pages by `placement` inside the block (the kernel's way after)."""
    mode, node_ids = placement.mode_and_nodes()
    if mode == MPOL_DEFAULT:
        yield
        return
    _set_mempolicy(mode, node_ids)
    try:
        yield
    finally:
        _set_mempolicy(MPOL_DEFAULT, [])


def _set_mempolicy(mode: int, node_ids: list[int]) -> None:
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise NumaError(f"--numa is not supported on {platform.machine()} yet")
    mask, maxnode = node_mask(node_ids) if node_ids else (None, 0)
    if _libc.syscall(number, mode, mask, ctypes.c_ulong(maxnode)) != 0:
        errno = ctypes.get_errno()
        raise NumaError(f"set_mempolicy({mode}, {node_ids}): {os.strerror(errno)}")


def bytes_per_node(numa_maps: str, match: str) -> dict[int, int]:
    """Bytes on each node of the mappings whose line contains `match` (numa_maps text)."""
    found: dict[int, int] = {}
    for line in numa_maps.splitlines():
        # numa_maps escapes blanks in file names, as in "/memfd:x\\040(deleted)".
        if match not in line.replace("\\040", " "):
            continue
        page = 4096
        counts = {}
        for field in line.split():
            key, _, value = field.partition("=")
            if key == "kernelpagesize_kB":
                page = int(value) << 10
            elif re.fullmatch(r"N\d+", key):
                counts[int(key[1:])] = int(value)
        for node, pages in counts.items():
            found[node] = found.get(node, 0) + pages * page
    return found
