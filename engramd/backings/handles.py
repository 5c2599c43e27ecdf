"""What a backing hands out for each tensor, as plain data.

Backings describe where a tensor's bytes are; engramd/api/wire.py alone turns
a description into the wire's `TensorHandle` (its kind follows from the form),
and a HandleKind into the wire's engramd.v1.HandleKind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HandleKind(enum.Enum):
    """How a worker reaches a set's memory; the values are ENGRAMD_HANDLES' names."""

    #: A file in the daemon's shm folder, opened by path (PathRange).
    SHM = "shm"
    #: A read-only descriptor collected on the fd channel (FileRange).
    FD = "fd"
    #: A cuMem allocation's descriptor, collected on the fd channel (CuMemRange.file).
    CUMEM = "cumem"
    #: A cuMem allocation's FABRIC handle, in the reply (CuMemRange.fabric).
    CUMEM_FABRIC = "fabric"


@dataclass(frozen=True)
class PathRange:
    """HandleKind.SHM: bytes of a file the worker opens by path, in the set's folder."""

    path: str
    offset: int
    length: int
    set_dir: str


@dataclass(frozen=True)
class FileRange:
    """HandleKind.FD: bytes of a file whose descriptor the worker collects on the fd channel."""

    #: The descriptor's name in the FdReply.
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class CuMemRange:
    """HandleKind.CUMEM (`file`) or CUMEM_FABRIC (`fabric`): bytes of one cuMem allocation."""

    #: The allocation's size: what the worker reserves and maps.
    size: int
    offset: int
    length: int
    #: The FdReply descriptor of the allocation ("" for a FABRIC handle).
    file: str = ""
    #: The allocation's CUmemFabricHandle (empty for a descriptor).
    fabric: bytes = b""
    #: Pinned host memory on this NUMA node; None: device memory of `device_uuid`.
    host_numa: int | None = None
    device_uuid: str = ""


@dataclass(frozen=True)
class Handle:
    """One tensor of a set and where a worker finds its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    where: PathRange | FileRange | CuMemRange
