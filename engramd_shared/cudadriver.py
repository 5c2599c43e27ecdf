"""The CUDA driver calls of cuMem allocations shared by handle, for both sides (no torch).

The cuda-host and cuda-device backings (engramd/backings/cuda.py) make,
map and export allocations; a worker (cumem.py) imports and maps them. The
calls go through NVIDIA's cuda-bindings driver module (`pip install
cuda-bindings`, engramd-node's `[cuda]` extra), imported only when a CUDA
backing or handle is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engramd_shared.errors import DeviceError

FIX_BINDINGS = "pip install cuda-bindings (NVIDIA's bindings; engramd-node's [cuda] extra)"
#: CUmemAllocationProp.requestedHandleTypes' byte offset (cuda.h; the same in every
#: CUDA 12 and 13). cuda-bindings accepts one handle type there, not a mask of two.
_HANDLE_TYPES_OFFSET = 4
_lock = threading.Lock()
_contexts: dict[int, Any] = {}


#: Where older cuda-python releases kept each module of cuda-bindings.
_LEGACY_MODULES = {"driver": "cuda.cuda", "runtime": "cuda.cudart"}


def bindings(part: str) -> Any | None:
    """cuda-bindings' `part` module ("driver" or "runtime"), or None where it is not installed."""
    for name in (f"cuda.bindings.{part}", _LEGACY_MODULES[part]):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


@functools.cache
def driver() -> Any:
    """cuda-bindings' driver module, initialised once; DeviceError saying what is missing.

    Cached: make_current runs for every chunk a device load copies. A failure
    is not cached, so a later call tries again.
    """
    module = bindings("driver")
    if module is None:
        raise DeviceError(f"cuMem handles need NVIDIA's cuda-bindings: {FIX_BINDINGS}")
    try:
        (err,) = module.cuInit(0)
    except RuntimeError as e:  # cuda-bindings' DynamicLibNotFoundError: no libcuda
        raise DeviceError(f"no CUDA driver on this machine ({e})") from None
    except BINDING_ERRORS as e:
        raise DeviceError(f"cuInit failed: {type(e).__name__}: {e}") from None
    if int(err):
        raise DeviceError(f"cuInit failed: CUDA error {int(err)} ({err!r}); no usable GPU")
    return module


def check(result: tuple[Any, ...], what: str) -> Any:
    """The value of a cuda-bindings call's (error, value...) result; DeviceError on an error."""
    err, *values = result
    if int(err):
        raise DeviceError(f"{what} failed: CUDA error {int(err)} ({err!r})")
    return values[0] if len(values) == 1 else tuple(values)


#: What cuda-bindings raises instead of returning an error: an argument of the wrong
#: type or value (TypeError, ValueError, OverflowError: a binding that changed its
#: signature), or RuntimeError (its DynamicLibNotFoundError: no libcuda).
BINDING_ERRORS = (TypeError, ValueError, OverflowError, RuntimeError)


def call(what: str, function: Callable[..., tuple[Any, ...]], *args: Any) -> Any:
    """`function(*args)` checked: DeviceError naming `what` on a CUDA error or a binding's raise."""
    try:
        result = function(*args)
    except BINDING_ERRORS as e:
        raise DeviceError(f"{what} failed: {type(e).__name__}: {e}") from None
    return check(result, what)


@contextlib.contextmanager
def building(what: str) -> Iterator[None]:
    """Map a binding's raise while filling one of its structures to DeviceError naming it."""
    try:
        yield
    except BINDING_ERRORS as e:
        raise DeviceError(f"{what}: {type(e).__name__}: {e}") from None


def make_current(index: int) -> Any:
    """Make device `index`'s primary context current on this thread; the driver module."""
    cu = driver()
    with _lock:
        ctx = _contexts.get(index)
        if ctx is None:
            device = call(f"cuDeviceGet({index})", cu.cuDeviceGet, index)
            ctx = _contexts[index] = call(
                f"cuDevicePrimaryCtxRetain({index})", cu.cuDevicePrimaryCtxRetain, device
            )
    call(f"cuCtxSetCurrent({index})", cu.cuCtxSetCurrent, ctx)
    return cu


def attribute(cu: Any, name: str, index: int) -> int:
    """A CU_DEVICE_ATTRIBUTE_<name> of device `index` (0 where this driver lacks it)."""
    attr = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
    if attr is None:
        return 0
    device = call(f"cuDeviceGet({index})", cu.cuDeviceGet, index)
    return int(call(f"cuDeviceGetAttribute({name})", cu.cuDeviceGetAttribute, attr, device))


def device_uuid(cu: Any, index: int) -> str:
    """Device `index`'s UUID as nvidia-smi prints it (GPU-xxxxxxxx-...)."""
    device = call(f"cuDeviceGet({index})", cu.cuDeviceGet, index)
    raw = bytes(call("cuDeviceGetUuid", cu.cuDeviceGetUuid, device).bytes).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"


def device_index(cu: Any, uuid: str) -> int | None:
    """The ordinal this process gives the GPU with `uuid`, or None where it does not see it."""
    for index in range(int(call("cuDeviceGetCount", cu.cuDeviceGetCount))):
        if device_uuid(cu, index) == uuid:
            return index
    return None


def location(cu: Any, host_numa: int | None, device: int | None) -> Any:
    """A CUmemLocation: host memory on NUMA node `host_numa`, or device `device`."""
    with building("CUmemLocation"):
        where = cu.CUmemLocation()
        if host_numa is not None:
            where.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            where.id = host_numa
        else:
            where.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            where.id = device or 0
        return where


def allocation_prop(cu: Any, host_numa: int | None, device: int | None, fabric: bool) -> Any:
    """Pinned memory at the location, exportable as a POSIX fd (and a FABRIC handle).

    Never read `requestedHandleTypes` back: with both types set, cuda-bindings
    raises ValueError (9 is no CUmemAllocationHandleType), so neither this
    code nor a log line may touch it (a repr of the structure included).
    """
    where = location(cu, host_numa, device)
    with building("CUmemAllocationProp"):
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = where
        types = cu.CUmemAllocationHandleType
        prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if fabric:
            # Both types at once: a mask the binding's enum field cannot hold.
            mask = int(types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) | int(
                types.CU_MEM_HANDLE_TYPE_FABRIC
            )
            ctypes.c_int.from_address(prop.getPtr() + _HANDLE_TYPES_OFFSET).value = mask
        return prop


def granularity(cu: Any, prop: Any) -> int:
    """The recommended size and alignment of allocations with `prop`."""
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity, prop, flag))


def access(cu: Any, device: int, cpu: bool, writable: bool = False) -> list[Any]:
    """Access descriptors: device `device` reads (writes), and the CPU too where `cpu`."""
    places = [location(cu, None, device), *([location(cu, 0, None)] if cpu else [])]
    with building("CUmemAccessDesc"):
        flags = cu.CUmemAccess_flags
        flag = (
            flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            if writable
            else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        )
        descs = []
        for where in places:
            desc = cu.CUmemAccessDesc()
            desc.location = where
            desc.flags = flag
            descs.append(desc)
        return descs


def set_access(cu: Any, pointer: int, size: int, device: int, cpu: bool, writable: bool) -> bool:
    """Grant device `device` (and the CPU, where `cpu`) read, or read and write, access.

    Read-only CPU access to host memory has no public production use, and a
    driver may refuse it: then read and write are granted instead, and the
    answer is False (the caller says so). True: what was asked is granted.
    """
    descs = access(cu, device, cpu, writable)
    try:
        call("cuMemSetAccess", cu.cuMemSetAccess, pointer, size, descs, len(descs))
        return True
    except DeviceError as refused:
        if writable or not cpu:
            raise
        descs = access(cu, device, cpu, writable=True)
        try:
            call("cuMemSetAccess", cu.cuMemSetAccess, pointer, size, descs, len(descs))
        except DeviceError:
            raise refused from None
        return False


@dataclass
class Mapped:
    """One allocation handle mapped at `pointer` in this process; `release` undoes it all."""

    handle: Any
    pointer: int
    size: int
    #: The device whose context made the mapping.
    device: int
    #: The mapping is readable by the CPU (host memory).
    cpu: bool
    #: Only reads are granted (False: the driver refused read-only CPU access, see set_access).
    read_only: bool = False
    _steps: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Unmap, free the address range, release the handle (the memory goes with the last)."""
        steps, self._steps = self._steps, []
        if not steps:
            return
        cu = make_current(self.device)
        if "mapped" in steps:
            call("cuMemUnmap", cu.cuMemUnmap, self.pointer, self.size)
        if "reserved" in steps:
            call("cuMemAddressFree", cu.cuMemAddressFree, self.pointer, self.size)
        if "handle" in steps:
            call("cuMemRelease", cu.cuMemRelease, self.handle)


def map_handle(
    cu: Any, handle: Any, size: int, align: int, device: int, cpu: bool, writable: bool = False
) -> Mapped:
    """Reserve `size` bytes of address space, map the allocation there, grant access.

    Takes ownership of `handle`: it is released on failure, and by `release`.
    """
    mapped = Mapped(handle, 0, size, device, cpu, _steps=["handle"])
    try:
        mapped.pointer = int(call("cuMemAddressReserve", cu.cuMemAddressReserve, size, align, 0, 0))
        mapped._steps.append("reserved")
        call(f"cuMemMap of {size} bytes", cu.cuMemMap, mapped.pointer, size, 0, handle, 0)
        mapped._steps.append("mapped")
        granted = set_access(cu, mapped.pointer, size, device, cpu, writable)
        mapped.read_only = granted and not writable
    except BaseException:
        mapped.release()
        raise
    return mapped


def import_handle(cu: Any, fd: int | None, fabric: bytes) -> Any:
    """The allocation behind a POSIX fd (the caller keeps `fd`) or a FABRIC handle."""
    types = cu.CUmemAllocationHandleType
    if fd is not None:
        return call(
            "cuMemImportFromShareableHandle (fd)",
            cu.cuMemImportFromShareableHandle,
            fd,
            types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    with building("CUmemFabricHandle"):
        shared = cu.CUmemFabricHandle()
        shared.data = fabric
    # The driver reads the handle's 64 bytes at an address: cuda-bindings takes an int
    # address or a buffer there, and raises TypeError for the structure itself.
    return call(
        "cuMemImportFromShareableHandle (fabric)",
        cu.cuMemImportFromShareableHandle,
        shared.getPtr(),
        types.CU_MEM_HANDLE_TYPE_FABRIC,
    )
