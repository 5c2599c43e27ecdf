"""The settings that are more than a number or a path, as typed values parsed once.

`--backing` and `--numa` are read from text where the settings are built
(the command line, a --config file, a test) and reach the server and the
backings as these values; nothing below parses them again. Each value's
`str` is the text that parses back to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engramd_shared.topology import NODES, nodes

#: Every `--backing` value: the names engramd.backings registers (BACKINGS, then COMBINED).
#: Written out here so that the CLI's help need not import the backings, whose CUDA
#: lookups and mapping helpers cost every command a tenth of a second; a test keeps
#: the two in step.
BACKING_NAMES = ("tmpfs", "hugetlbfs", "memfd", "disk", "cuda-host", "cuda-device", "auto")
#: The backings that take a device index: `--backing cuda-device:N` is GPU N's memory.
DEVICE_BACKINGS = ("cuda-device",)
#: `--numa per-node`: a copy of each set on every node with memory.
PER_NODE = "per-node"


@dataclass(frozen=True)
class BackingSpec:
    """Where sets live, as `--backing` names it: a backing's name and, for some, a device."""

    #: A name in BACKING_NAMES.
    name: str = "tmpfs"
    #: The device index of a backing in DEVICE_BACKINGS (None: device 0).
    device: int | None = None

    @classmethod
    def parse(cls, text: str) -> BackingSpec:
        """A spec from `--backing`; ValueError naming the backings there are."""
        name, colon, index = text.strip().partition(":")
        if name not in BACKING_NAMES:
            raise ValueError(f"{text!r} is not a backing (known: {', '.join(BACKING_NAMES)})")
        if not colon:
            return cls(name)
        if name not in DEVICE_BACKINGS or not index.isdigit():
            raise ValueError(
                f"{text!r}: only {'/'.join(DEVICE_BACKINGS)} takes a device, "
                "as cuda-device:N, N a CUDA device index"
            )
        return cls(name, int(index))

    def __str__(self) -> str:
        return self.name if self.device is None else f"{self.name}:{self.device}"


class NumaError(ValueError):
    """A placement that cannot be made: names the nodes there are."""


@dataclass(frozen=True)
class Placement:
    """Where a set's pages go: "" (the kernel's choice), "interleave", "node:N" or "per-node".

    "" leaves placement to the kernel (first touch); "interleave" spreads
    pages over every node with memory; "node:N" binds them to node N;
    "per-node" keeps one copy of a set per node, each bound to its node, and
    hands a worker the copy of the node its CPUs are on.
    """

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
                f"{text!r}: use interleave, node:N or {PER_NODE} (N one of {list(found)})"
            )
        if int(match.group(1)) not in found:
            raise NumaError(f"node {match.group(1)} has no memory; nodes: {list(found)}")
        return cls(text, found)

    def __str__(self) -> str:
        return self.policy

    @property
    def interleaved(self) -> bool:
        """Pages spread over every node."""
        return self.policy == "interleave"

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
