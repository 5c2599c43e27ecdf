"""Sets in cuMem allocations shared by handle: pinned host memory, or one GPU's memory.

One allocation per set copy (cuMemCreate, pinned), tensors packed at
4 KiB-aligned offsets, the size rounded up to the driver's recommended
granularity:

    cuda-host      location HOST_NUMA: the copy's node (--numa node:N, a
                   per-node copy's node), else the node nearest the GPU
                   (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID), else 0
    cuda-device:N  location DEVICE N: HBM, shared with every worker on that
                   GPU (or a peer GPU that may map it)

Requested handle types: POSIX file descriptor, plus FABRIC where the device
supports it and an IMEX channel exists. The daemon maps the allocation for
itself, the loader fills it (host: CPU stores; device: cuMemcpyHtoD), every
tensor's checksum is recomputed from the allocation, and only then is the
copy published; the daemon's own access drops to read-only then. Workers
collect the exported descriptor on the fd channel (HandleKind.CUMEM) or
get the fabric handle in the reply (HandleKind.CUMEM_FABRIC) and import
it (engramd_shared/cudadriver.py): no per-worker pinning.

Restarts: an allocation lives while the daemon or any worker that imported
it holds it. A daemon that exits leaves every worker's tables mapped and
readable; its copies are not adopted (survives_restart is false) and the
next daemon loads them again. A worker's lease then re-attaches to the new
copy and shows as stale until it calls Tables.refresh(); until it does, the
node holds both copies.

Where the driver or device cannot do this, `from_config` raises
BackingUnavailable with the reason and the daemon uses tmpfs/memfd instead
(backings_for), where workers register their own mapping (cuda.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from abc import abstractmethod
from pathlib import Path
from typing import ClassVar

from engramd.backings.base import Backing, BackingUnavailable, StagedSet, Usage
from engramd.backings.cudacopy import (
    FIX_HOST,
    TABLES,
    Copy,
    StagedCopy,
    address,
    release,
)
from engramd.backings.cudaprobe import trial
from engramd.backings.handles import CuMemRange, Handle, HandleKind
from engramd.checksum import BUFFER_BYTES
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.memlimit import check_memory, memory_limit
from engramd.host.pinning import PinnedFiles
from engramd.strong import digester
from engramd.units import gib
from engramd_shared import cudadriver
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import DeviceError, ShmCapacityError, UnknownSet
from engramd_shared.layout import Manifest, ManifestError, extents, packed_offsets

log = logging.getLogger("engramd")

#: Where the driver creates IMEX channels; FABRIC handles need one.
IMEX_CHANNELS = Path("/dev/nvidia-caps-imex-channels")


class CudaBackingBase(Backing):
    """What cuda-host and cuda-device share: one exported cuMem allocation per set copy."""

    #: The CPU reads the allocation (host memory).
    host: ClassVar[bool]

    def __init__(
        self,
        device: int,
        host_numa: int | None,
        fabric: bool,
        page_size: int,
        cpu_read_only: bool = True,
    ) -> None:
        #: The device whose context the daemon uses (and, for cuda-device, that holds the sets).
        self.device = device
        #: cuda-host: the NUMA node of copies that are not per-node.
        self.node = host_numa
        #: Allocations also export FABRIC handles.
        self.fabric = fabric
        self.handle_kinds = frozenset(
            {HandleKind.CUMEM, *([HandleKind.CUMEM_FABRIC] if fabric else [])}
        )
        #: The allocation granularity: sets take whole multiples of it.
        self.page_size = page_size
        #: The driver grants the daemon's mapping read-only CPU access once a copy is
        #: published (cudaprobe's trial); False: it stays read-write.
        self.cpu_read_only = cpu_read_only or not self.host
        self.uuid = cudadriver.device_uuid(cudadriver.make_current(device), device)
        self._copies: dict[str, Copy] = {}
        self._lock = threading.Lock()

    def host_node(self, node: int | None) -> int | None:
        """The NUMA node of a copy's host memory: a per-node copy's node, else the backing's.

        None for device memory (cuda-device).
        """
        return self.memory_node(node) if self.host else None

    @classmethod
    def probe(cls, device: int, host_numa: int | None) -> tuple[bool, int, bool]:
        """(fabric handles work, granularity, read-only CPU access) of allocations here.

        BackingUnavailable where the attributes say no, or where a trial
        allocation in a child process (cudaprobe) crashes, hangs or fails.
        """
        try:
            cu = cudadriver.driver()
            count = int(cudadriver.call("cuDeviceGetCount", cu.cuDeviceGetCount))
            if device >= count:
                raise DeviceError(f"this process sees {count} CUDA device(s), not cuda:{device}")
            cu = cudadriver.make_current(device)
            needs = [
                "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
            ]
            if cls.host:
                needs.append("HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
            missing = [n for n in needs if not cudadriver.attribute(cu, n, device)]
            if missing:
                raise DeviceError(f"cuda:{device} lacks {', '.join(missing).lower()}")
            fabric = bool(cudadriver.attribute(cu, "HANDLE_TYPE_FABRIC_SUPPORTED", device)) and any(
                IMEX_CHANNELS.glob("channel*")
            )
            node = host_numa if cls.host else None
            prop = cudadriver.allocation_prop(cu, node, device, fabric)
            granule = cudadriver.granularity(cu, prop)
            return fabric, granule, trial(device, node, fabric)
        except DeviceError as e:
            raise BackingUnavailable(cls.name, str(e)) from None

    @property
    def survives_restart(self) -> bool:
        """Never: no later daemon can take over an allocation (workers keep their imports)."""
        return False

    def claim(self) -> None:
        """Say where sets go and what a restart does."""
        log.info(
            "%s sets: cuMem allocations on %s (%s), pinned, handed out as %s handles; a "
            "restart loads them again, while running workers keep the copy they imported",
            self.name,
            self._where(),
            self.uuid,
            "POSIX fd and FABRIC" if self.fabric else "POSIX fd",
        )
        if not self.cpu_read_only:
            log.warning(
                "%s: the driver refuses read-only CPU access to host memory (cuMemSetAccess "
                "PROT_READ), so the daemon's own mapping of each set stays read-write after "
                "its load; workers' imports ask for read-only access",
                self.name,
            )

    def _where(self, node: int | None = None) -> str:
        return f"cuda:{self.device}"

    def footprint(self, sizes: list[int]) -> int:
        """One packed allocation in whole granules."""
        return self.reserved(packed_offsets(sizes)[1])

    def _used(self) -> int:
        with self._lock:
            manifests = [c.manifest for c in self._copies.values() if c.manifest is not None]
        return sum(self.footprint(extents(m.tensors)) for m in manifests)

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        """A mapped allocation of the set's whole size, exported; nothing hands it out yet."""
        return StagedCopy(self, plan, node)

    def adopt(self) -> list[Manifest]:
        """Nothing: allocations do not outlive the daemon that made them."""
        return []

    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        """Nothing to do: cuMem allocations are pinned from cuMemCreate on."""

    def checksum(self, manifest: Manifest, index: int, like: str = "") -> str:
        """The digest, of the kind `like` names (the manifest's checksum's by default), of the
        tensor's bytes as they are in the allocation now."""
        t = manifest.tensors[index]
        with self._lock:
            copy = self._copies.get(manifest.copy)
        gone = ManifestError(f"set {manifest.copy} is no longer held")
        if copy is None:
            raise gone
        # The copy's own lock, not the backing's: status and attaches go on meanwhile,
        # and remove() waits to unmap until this read is done.
        with copy.lock:
            if copy.released:
                raise gone
            return self._digest(copy.mapped.pointer + t.offset, t.nbytes, like or t.checksum)

    def _digest(self, pointer: int, nbytes: int, like: str) -> str:
        digest = digester(like)
        for at in range(0, nbytes, BUFFER_BYTES):
            digest.update(self._read(pointer + at, min(BUFFER_BYTES, nbytes - at)))
        return digest.label()

    @abstractmethod
    def _read(self, pointer: int, nbytes: int) -> memoryview:
        """`nbytes` of the allocation at `pointer`, readable until the next call on this thread."""

    @abstractmethod
    def _write(self, pointer: int, data: memoryview) -> None:
        """Copy `data` into the allocation at `pointer`."""

    def remove(self, copy: str) -> None:
        """Unmap the daemon's mapping and close its handle; workers keep what they imported."""
        with self._lock:
            held = self._copies.pop(copy, None)
        if held is not None:
            release(held)

    def handles(self, manifest: Manifest, kind: HandleKind) -> list[Handle]:
        """One CuMemHandle per tensor, all into the copy's one allocation."""
        with self._lock:
            held = self._copies.get(manifest.copy)
        if held is None:
            raise UnknownSet(
                f"set {manifest.copy} was dropped while the worker waited; attach again"
            )
        fabric = kind is HandleKind.CUMEM_FABRIC
        host_node = self.host_node(manifest.node)
        return [
            Handle(
                t.name,
                t.dtype,
                t.shape,
                CuMemRange(
                    size=held.mapped.size,
                    offset=t.offset,
                    length=t.nbytes,
                    file="" if fabric else TABLES,
                    fabric=held.fabric if fabric else b"",
                    host_numa=host_node,
                    device_uuid="" if host_node is not None else self.uuid,
                ),
            )
            for t in manifest.tensors
        ]

    def mapped_as(self, copy: str) -> str | None:
        """None: driver mappings carry no name in numa_maps."""
        return None

    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        """A duplicate of the allocation's descriptor as workers get it (read_only_handle)."""
        with self._lock:
            held = self._copies.get(manifest.copy)
            if held is None:
                raise OSError(f"set {manifest.copy} is no longer held")
            return [(TABLES, os.dup(held.exported))]


class CudaHostBacking(CudaBackingBase):
    """Pinned host memory on a NUMA node, GPU-readable, shared by cuMem handle."""

    name: ClassVar[str] = "cuda-host"
    host: ClassVar[bool] = True

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> Backing:
        """Device 0's context; the node of --numa node:N, else the GPU's nearest node."""
        node = config.numa.node
        if node is None:
            try:
                cu = cudadriver.driver()
                nearest = cudadriver.attribute(cu, "HOST_NUMA_ID", 0)
            except DeviceError as e:
                raise BackingUnavailable(cls.name, str(e)) from None
            node = nearest if nearest >= 0 else 0
        fabric, granule, cpu_read_only = cls.probe(0, node)
        return cls(0, node, fabric, granule, cpu_read_only)

    def _where(self, node: int | None = None) -> str:
        return f"host NUMA node {self.host_node(node)}"

    def usage(self) -> Usage:
        """The daemon's memory bound, as for memfd sets (memlimit.py)."""
        limit = memory_limit()
        return Usage(limit.where, limit.total, self._used(), limit.available, self.page_size)

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Refuse a set larger than the daemon's memory bound, or its room."""
        check_memory(needed, what, reclaimable, FIX_HOST)

    def _read(self, pointer: int, nbytes: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * nbytes).from_address(pointer)).cast("B")

    def _write(self, pointer: int, data: memoryview) -> None:
        memoryview((ctypes.c_ubyte * len(data)).from_address(pointer)).cast("B")[:] = data


class CudaDeviceBacking(CudaBackingBase):
    """Memory of one GPU (--backing cuda-device:N), shared by cuMem handle."""

    name: ClassVar[str] = "cuda-device"
    host: ClassVar[bool] = False

    def __init__(self, device: int, host_numa: int | None, fabric: bool, page_size: int) -> None:
        super().__init__(device, host_numa, fabric, page_size, cpu_read_only=True)
        self._buffers = threading.local()

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> Backing:
        """The GPU of `--backing cuda-device:N` (cuda-device alone: GPU 0)."""
        device = config.backing.device or 0
        fabric, granule, _ = cls.probe(device, None)
        return cls(device, None, fabric, granule)

    def usage(self) -> Usage:
        """The GPU's memory (cuMemGetInfo): what every process on it leaves free."""
        cu = cudadriver.make_current(self.device)
        free, total = cudadriver.call("cuMemGetInfo", cu.cuMemGetInfo)
        return Usage(
            f"cuda:{self.device} {self.uuid}", int(total), self._used(), int(free), self.page_size
        )

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Refuse a set larger than the GPU's free memory."""
        usage = self.usage()
        if needed > usage.free + reclaimable:
            raise ShmCapacityError(
                f"{what} needs {gib(needed)} of GPU memory but cuda:{self.device} has "
                f"{gib(usage.free)} of {gib(usage.total)} free; drop unused sets, free the GPU, "
                "or use --backing cuda-host"
            )

    def _read(self, pointer: int, nbytes: int) -> memoryview:
        buffer = getattr(self._buffers, "buffer", None)
        if buffer is None:
            buffer = self._buffers.buffer = bytearray(BUFFER_BYTES)
        cu = cudadriver.make_current(self.device)
        cudadriver.call("cuMemcpyDtoH", cu.cuMemcpyDtoH, address(buffer), pointer, nbytes)
        return memoryview(buffer)[:nbytes]

    def _write(self, pointer: int, data: memoryview) -> None:
        cu = cudadriver.make_current(self.device)
        cudadriver.call("cuMemcpyHtoD", cu.cuMemcpyHtoD, pointer, address(data), len(data))
