"""What callers ask of the sets, and what the sets answer, as plain values.

The api/ translates engramd.v1 messages to these (api/requests.py) and these
back to messages (api/wire.py): nothing under engramd.sets reads a stub.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engramd.backings.handles import HandleKind

if TYPE_CHECKING:
    from engramd.sets.leases import Lease
    from engramd.sets.tableset import TableSet


class GpuRoute(enum.IntEnum):
    """How a worker's device reads a set (the numbers are engramd.v1.GpuRoute's)."""

    UNSPECIFIED = 0
    CUMEM_IMPORT = 1
    REGISTER_READ_ONLY = 2
    HOST_PAGE_TABLES = 3
    REGISTER_WRITABLE = 4


@dataclass(frozen=True)
class AttachIntent:
    """A worker's attach: which set, from which files, who asks, how it maps the set."""

    set_id: str
    #: The checkpoint as the worker names it ("": attach by id).
    checkpoint: str = ""
    #: The selection the worker planned with ("": the daemon's).
    tensors: str = ""
    #: The worker's pid, as it claims it (0: unknown).
    pid: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    #: The handle kinds the worker maps, in its order of preference (this daemon's kinds only).
    accept: tuple[HandleKind, ...] = (HandleKind.SHM,)
    #: The worker lost the daemon and keeps its mappings: never load.
    reattach: bool = False
    #: With reattach: the nonce of the copy it maps.
    nonce: str = ""
    #: The worker's pid namespace inode and its process's start time, as it claims them.
    pid_namespace: int = 0
    pid_start: int = 0
    #: The NUMA node of the worker's CPUs (None: unknown).
    numa_node: int | None = None
    #: "cuda:N", or "" for CPU tensors only.
    device: str = ""
    gpu_route: GpuRoute = GpuRoute.UNSPECIFIED


@dataclass(frozen=True)
class LoadIntent:
    """The operator's load: a checkpoint and a selection ("": the configured one)."""

    checkpoint: str
    tensors: str = ""
    #: The published set this load replaces as its next generation ("": the set loaded
    #: from the same checkpoint before, if any).
    replaces: str = ""


@dataclass(frozen=True)
class Progress:
    """Bytes of a load (or of a proof) done so far, of all it will take."""

    done: int
    total: int


@dataclass(frozen=True)
class Granted:
    """An attach answered: the set, the worker's lease, and how it maps the set."""

    ts: TableSet
    lease: Lease
    kind: HandleKind
    #: The checkpoint files the set came from may be told to the caller.
    reveal_sources: bool


@dataclass(frozen=True)
class Loaded:
    """An operator's load done: the set (its first copy), published."""

    ts: TableSet


@dataclass(frozen=True)
class Verified:
    """An operator's verify done: the set (its first copy) and what failed."""

    ts: TableSet
    #: Its tensors whose bytes changed (a per-node copy's named with its node), and any
    #: other finding (an attestation that does not hold).
    corrupted: list[str]
    #: Leases whose workers were told their copy failed verification.
    told: int = 0
    #: How the operator gets a copy served again, where one failed ("" if none did).
    fix: str = ""
