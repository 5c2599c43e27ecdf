"""A CUDA driver for machines without a GPU: the cuMem calls engramd makes, over memfds.

tests/test_cuda_backings.py puts this package first on the PYTHONPATH of a
daemon and its workers where no CUDA driver works, so the code around the
driver calls (the cuda-host backing's allocation, load, check, export and
removal; the fd channel; a worker's import and CPU views) runs for real.
What only a GPU shows (device access, UVA, FABRIC handles, cuda-device)
runs in tests/gpu with the real driver.

One device. An allocation (host memory on a NUMA node, or "device"
memory) is a memfd; exporting it dups the descriptor; an address
reservation is a PROT_NONE mapping that cuMemMap replaces with the memfd
(MAP_FIXED) and cuMemSetAccess opens for the CPU as the HOST_NUMA access
descriptor says (never, for device memory: the CPU reaches it only by
cuMemcpyHtoD / cuMemcpyDtoH). Results are (CUresult, value...) tuples, as
cuda-bindings returns them.

FAKE_CUDA_FAULTS (comma-separated) makes it behave as drivers that were
reported to: "crash-in-cumemcreate" kills the process with SIGSEGV in
cuMemCreate (host-NUMA cuMemCreate on r560-r580, NCCL #2106);
"no-read-only-cpu" refuses read-only CPU access (cuMemSetAccess PROT_READ
on HOST_NUMA). runtime.py reads the same variable.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import mmap
import os
import signal
from dataclasses import dataclass, field
from typing import Any

GRANULARITY = 2 << 20
#: The driver faults to act out (see the module's docstring).
FAULTS = frozenset(filter(None, os.environ.get("FAKE_CUDA_FAULTS", "").split(",")))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 141


_ATTRIBUTES = {102: 1, 103: 1, 128: 0, 134: 0, 141: 1}


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 3


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_FABRIC = 8


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


@dataclass
class CUmemLocation:
    type: CUmemLocationType = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
    id: int = 0


@dataclass
class CUmemAllocationProp:
    type: CUmemAllocationType = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
    requestedHandleTypes: CUmemAllocationHandleType = (
        CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    )
    location: CUmemLocation = field(default_factory=CUmemLocation)


@dataclass
class CUmemAccessDesc:
    location: CUmemLocation = field(default_factory=CUmemLocation)
    flags: CUmemAccess_flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


@dataclass
class CUuuid:
    bytes: bytes = bytes(range(16))


@dataclass
class _Allocation:
    fd: int
    size: int
    prop: CUmemAllocationProp


_handles: dict[int, _Allocation] = {}
#: Mapped address ranges: start -> (descriptor, size), for the copies.
_mapped: dict[int, tuple[int, int]] = {}
_next_handle = itertools.count(1)
_OK = CUresult.CUDA_SUCCESS


def cuInit(flags: int) -> tuple[Any, ...]:
    return (_OK,)


def cuDeviceGetCount() -> tuple[Any, ...]:
    return _OK, 1


def cuDeviceGet(ordinal: int) -> tuple[Any, ...]:
    return (_OK, 0) if ordinal == 0 else (CUresult.CUDA_ERROR_INVALID_DEVICE, None)


def cuDevicePrimaryCtxRetain(device: int) -> tuple[Any, ...]:
    return _OK, object()


def cuCtxSetCurrent(context: object) -> tuple[Any, ...]:
    return (_OK,)


def cuDeviceGetAttribute(attribute: int, device: int) -> tuple[Any, ...]:
    return _OK, _ATTRIBUTES.get(int(attribute), 0)


def cuDeviceGetUuid(device: int) -> tuple[Any, ...]:
    return _OK, CUuuid()


def cuMemGetAllocationGranularity(prop: CUmemAllocationProp, flag: int) -> tuple[Any, ...]:
    return _OK, GRANULARITY


def cuMemGetInfo() -> tuple[Any, ...]:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return _OK, pages, pages


def cuMemCreate(size: int, prop: CUmemAllocationProp, flags: int) -> tuple[Any, ...]:
    host_or_device = (
        CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA,
        CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
    )
    if prop.location.type not in host_or_device:
        return CUresult.CUDA_ERROR_NOT_SUPPORTED, None
    if size % GRANULARITY:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
    if "crash-in-cumemcreate" in FAULTS:
        os.kill(os.getpid(), signal.SIGSEGV)
    fd = os.memfd_create("fake-cumem", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
    return _OK, _hold(_Allocation(fd, size, prop))


def _hold(allocation: _Allocation) -> int:
    handle = next(_next_handle)
    _handles[handle] = allocation
    return handle


def cuMemRelease(handle: int) -> tuple[Any, ...]:
    allocation = _handles.pop(handle, None)
    if allocation is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    os.close(allocation.fd)
    return (_OK,)


def cuMemExportToShareableHandle(handle: int, kind: int, flags: int) -> tuple[Any, ...]:
    allocation = _handles.get(handle)
    if (
        allocation is None
        or kind != CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    ):
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
    return _OK, os.dup(allocation.fd)


def cuMemImportFromShareableHandle(shared: Any, kind: int) -> tuple[Any, ...]:
    if kind != CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        return CUresult.CUDA_ERROR_NOT_SUPPORTED, None
    fd = os.dup(shared)
    # The location is not in the descriptor; the importer takes it from engramd's handle.
    prop = CUmemAllocationProp(
        CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED,
        CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    )
    return _OK, _hold(_Allocation(fd, os.fstat(fd).st_size, prop))


def cuMemGetAllocationPropertiesFromHandle(handle: int) -> tuple[Any, ...]:
    allocation = _handles.get(handle)
    if allocation is None:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
    return _OK, allocation.prop


def _mmap(address: int, size: int, prot: int, flags: int, fd: int) -> int | None:
    result = _libc.mmap(address or None, size, prot, flags, fd, 0)
    return None if result in (None, ctypes.c_void_p(-1).value) else int(result)


def cuMemAddressReserve(size: int, alignment: int, address: int, flags: int) -> tuple[Any, ...]:
    align = alignment or GRANULARITY
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    reserved = _mmap(0, size + align, _PROT_NONE, flags, -1)
    if reserved is None:
        return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
    start = -(-reserved // align) * align
    if start > reserved:
        _libc.munmap(reserved, start - reserved)
    _libc.munmap(start + size, reserved + align - start)
    return _OK, start


def cuMemAddressFree(pointer: int, size: int) -> tuple[Any, ...]:
    return (_OK if _libc.munmap(pointer, size) == 0 else CUresult.CUDA_ERROR_INVALID_VALUE,)


def cuMemMap(pointer: int, size: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:
    allocation = _handles.get(handle)
    if allocation is None or offset or size > allocation.size or pointer % GRANULARITY:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    mapped = _mmap(pointer, size, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, allocation.fd)
    if mapped != pointer:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    _mapped[pointer] = (allocation.fd, size)
    return (_OK,)


def _at(pointer: int, count: int) -> tuple[int, int] | None:
    """(descriptor, offset) of `count` bytes at a mapped address, or None."""
    for start, (fd, size) in _mapped.items():
        if start <= pointer and pointer + count <= start + size:
            return fd, pointer - start
    return None


def cuMemcpyHtoD(pointer: int, source: int, count: int) -> tuple[Any, ...]:
    found = _at(pointer, count)
    if found is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    fd, offset = found
    os.pwrite(fd, ctypes.string_at(source, count), offset)
    return (_OK,)


def cuMemcpyDtoH(destination: int, pointer: int, count: int) -> tuple[Any, ...]:
    found = _at(pointer, count)
    if found is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    fd, offset = found
    ctypes.memmove(destination, os.pread(fd, count, offset), count)
    return (_OK,)


def cuMemUnmap(pointer: int, size: int) -> tuple[Any, ...]:
    _mapped.pop(pointer, None)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    kept = _mmap(pointer, size, _PROT_NONE, flags, -1)
    return (_OK if kept == pointer else CUresult.CUDA_ERROR_INVALID_VALUE,)


def cuMemSetAccess(
    pointer: int, size: int, descs: list[CUmemAccessDesc], count: int
) -> tuple[Any, ...]:
    prot = _PROT_NONE
    for desc in descs[:count]:
        if desc.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA:
            read_only = desc.flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only and "no-read-only-cpu" in FAULTS:
                return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
            prot = {
                CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ: mmap.PROT_READ,
                CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: mmap.PROT_READ
                | mmap.PROT_WRITE,
            }.get(desc.flags, _PROT_NONE)
    return (_OK if _libc.mprotect(pointer, size, prot) == 0 else CUresult.CUDA_ERROR_INVALID_VALUE,)
