"""One set copy's cuMem allocation: created and exported, filled, checked, published, released.

The two CUDA backings (cuda.py) differ in where the allocation lives and
how the CPU reaches it; the allocation's life is the same for both.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engramd.backings.base import StagedSet
from engramd.units import gib
from engramd_shared import cudadriver
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import DeviceError, LoadFailed, ShmCapacityError
from engramd_shared.layout import Manifest, copy_name, extents, packed_tensors

if TYPE_CHECKING:
    from engramd.backings.cuda import CudaBackingBase

log = logging.getLogger("engramd")

#: The name of a set's allocation in its handles and on the fd channel.
TABLES = "tables"
FIX_HOST = (
    "raise the daemon's memory limit (systemd MemoryMax=, the container's memory limit), "
    "drop unused sets, or use --backing cuda-device:N for sets that fit in GPU memory"
)


@dataclass
class Copy:
    """A copy's allocation: the daemon's mapping of it and its exported handles."""

    mapped: cudadriver.Mapped
    #: The POSIX file descriptor exported from the allocation, as workers get it
    #: (read_only_handle).
    exported: int
    #: The FABRIC handle, or b"".
    fabric: bytes
    manifest: Manifest | None = None
    #: Held while the daemon reads the allocation, and to release it.
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False


def address(buffer: bytearray | memoryview) -> int:
    """The address of a writable buffer's first byte (the loader's), for the driver's copies."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class StagedCopy(StagedSet):
    """A copy being loaded into its own allocation, exported before a byte is written."""

    def __init__(self, backing: CudaBackingBase, plan: TablePlan, node: int | None) -> None:
        self._backing = backing
        self._plan = plan
        self._offsets, _ = packed_tensors(plan.tensors)
        size = max(backing.footprint(extents(plan.tensors)), backing.page_size)
        cu = cudadriver.make_current(backing.device)
        prop = cudadriver.allocation_prop(
            cu, backing.host_node(node), backing.device, backing.fabric
        )
        where = backing._where(node)
        try:
            handle = cudadriver.call(f"cuMemCreate of {gib(size)}", cu.cuMemCreate, size, prop, 0)
        except DeviceError as e:
            raise ShmCapacityError(
                f"could not allocate {gib(size)} on {where} for set {plan.set_id} ({e}); "
                + (FIX_HOST if backing.host else "drop unused sets or free the GPU")
            ) from None
        self._mapped = cudadriver.map_handle(
            cu, handle, size, backing.page_size, backing.device, backing.host, writable=True
        )
        self._exported = -1
        try:
            types = cu.CUmemAllocationHandleType
            exported = int(
                cudadriver.call(
                    "cuMemExportToShareableHandle (fd)",
                    cu.cuMemExportToShareableHandle,
                    handle,
                    types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            )
            self._exported = read_only_handle(exported)
            self._fabric = b""
            if backing.fabric:
                shared = cudadriver.call(
                    "cuMemExportToShareableHandle (fabric)",
                    cu.cuMemExportToShareableHandle,
                    handle,
                    types.CU_MEM_HANDLE_TYPE_FABRIC,
                    0,
                )
                self._fabric = bytes(shared.data)
        except BaseException:
            if self._exported >= 0:
                os.close(self._exported)
            self._mapped.release()
            raise
        log.debug("set %s: %s allocated on %s", copy_name(plan.set_id, node), gib(size), where)

    def placement(self, index: int) -> tuple[str, int]:
        """Every tensor in the copy's one allocation, packed."""
        return TABLES, self._offsets[index]

    def write(self, index: int, data: memoryview, offset: int) -> None:
        """CPU stores (host memory) or cuMemcpyHtoD (device memory)."""
        self._backing._write(self._mapped.pointer + self._offsets[index] + offset, data)

    def publish(self, manifest: Manifest) -> None:
        """Check every tensor against its load-time checksum, drop to read-only, hand it out."""
        backing = self._backing
        for t in manifest.tensors:
            found = backing._digest(self._mapped.pointer + t.offset, t.nbytes, t.checksum)
            if found != t.checksum:
                raise LoadFailed(
                    f"tensor {t.name!r} of set {manifest.set_id} reads back from "
                    f"{backing.name} memory as {found}, not the {t.checksum} loaded; "
                    "the allocation is not served (a driver or hardware fault?)"
                )
        if backing.cpu_read_only:
            # Refused in the trial (the backing's claim said so): the load's read-write stays.
            cu = cudadriver.make_current(backing.device)
            mapped = self._mapped
            cudadriver.set_access(
                cu, mapped.pointer, mapped.size, backing.device, backing.host, writable=False
            )
        with backing._lock:
            backing._copies[manifest.copy] = Copy(
                self._mapped, self._exported, self._fabric, manifest
            )

    def discard(self) -> None:
        """Release the allocation: nothing was handed out."""
        release(Copy(self._mapped, self._exported, self._fabric))


def read_only_handle(exported: int) -> int:
    """What workers get of an exported allocation descriptor: read-only where it is a file.

    A descriptor that is a file (a memfd: the simulated driver's allocations)
    is opened again read-only, as memfd sets are, so a worker can neither map
    it PROT_WRITE nor write through it; the read-write export is closed. A
    real driver's handle is no such file (opening it again through /proc
    would open the driver's device anew, not the allocation): it goes out as
    it is, and each importer's own cuMemSetAccess decides what it may do
    (docs/gpu.md, "cuda-host and cuda-device").
    """
    if not stat.S_ISREG(os.fstat(exported).st_mode):
        return exported
    try:
        # A worker could open its descriptor again through /proc/self/fd: the
        # file's own mode (a memfd's is 0777) must refuse it writing too.
        os.fchmod(exported, 0o400)
        return os.open(f"/proc/self/fd/{exported}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(exported)


def release(copy: Copy) -> None:
    """Close the exported descriptor and free the daemon's mapping of the allocation."""
    with copy.lock:
        copy.released = True
        os.close(copy.exported)
        with contextlib.suppress(DeviceError):
            # A driver already torn down (daemon exit) frees everything anyway.
            copy.mapped.release()
