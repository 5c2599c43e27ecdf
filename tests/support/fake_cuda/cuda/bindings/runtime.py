"""The CUDA runtime calls of a worker's registration (engramd_client/cuda.py), without a GPU.

One device. cudaHostRegister acts as the kernel under the real driver
does: pinning a range for the device's writes needs writable pages, so a
read-only mapping registers only with cudaHostRegisterReadOnly, and that
flag only where the device supports it. The device attributes answer as
FAKE_CUDA_FAULTS (driver.py) asks:

    no-read-only-register   cudaDevAttrHostRegisterReadOnlySupported is 0
                            (discrete x86 GPUs, vllm-omni #6240)
    host-page-tables        cudaDevAttrPageableMemoryAccessUsesHostPageTables is 1 (ATS)

`registered` holds what is registered now: start -> (bytes, flags).
"""

from __future__ import annotations

import enum
import os
from typing import Any

FAULTS = frozenset(filter(None, os.environ.get("FAKE_CUDA_FAULTS", "").split(",")))
_READ_ONLY = 0x08

registered: dict[int, tuple[int, int]] = {}


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidDevice = 101
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713
    cudaErrorNotSupported = 801


class cudaDeviceAttr(enum.IntEnum):
    cudaDevAttrCanUseHostPointerForRegisteredMem = 91
    cudaDevAttrPageableMemoryAccess = 88
    cudaDevAttrPageableMemoryAccessUsesHostPageTables = 100
    cudaDevAttrHostRegisterReadOnlySupported = 113


_OK = cudaError_t.cudaSuccess


def cudaDeviceGetAttribute(attr: int, device: int) -> tuple[Any, ...]:
    if device != 0:
        return cudaError_t.cudaErrorInvalidDevice, 0
    answers = {
        cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem: 1,
        cudaDeviceAttr.cudaDevAttrPageableMemoryAccess: int("host-page-tables" in FAULTS),
        cudaDeviceAttr.cudaDevAttrPageableMemoryAccessUsesHostPageTables: int(
            "host-page-tables" in FAULTS
        ),
        cudaDeviceAttr.cudaDevAttrHostRegisterReadOnlySupported: int(
            "no-read-only-register" not in FAULTS
        ),
    }
    return _OK, answers.get(cudaDeviceAttr(attr), 0)


def cudaSetDevice(device: int) -> tuple[Any, ...]:
    return (_OK if device == 0 else cudaError_t.cudaErrorInvalidDevice,)


def _writable(start: int, size: int) -> bool | None:
    """Whether every page of [start, start + size) is mapped writable; None: not all mapped."""
    end, at, writable = start + size, start, True
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= at < high:
                writable = writable and perms[1] == "w"
                at = high
                if at >= end:
                    return writable
    return None


def cudaHostRegister(ptr: int, size: int, flags: int) -> tuple[Any, ...]:
    if ptr in registered:
        return (cudaError_t.cudaErrorHostMemoryAlreadyRegistered,)
    writable = _writable(ptr, size)
    if writable is None:
        return (cudaError_t.cudaErrorInvalidValue,)
    if flags & _READ_ONLY:
        if "no-read-only-register" in FAULTS:
            return (cudaError_t.cudaErrorNotSupported,)
    elif not writable:
        # The kernel refuses to pin read-only pages for the device's writes.
        return (cudaError_t.cudaErrorInvalidValue,)
    registered[ptr] = (size, flags)
    return (_OK,)


def cudaHostUnregister(ptr: int) -> tuple[Any, ...]:
    if registered.pop(ptr, None) is None:
        return (cudaError_t.cudaErrorHostMemoryNotRegistered,)
    return (_OK,)


def cudaHostGetDevicePointer(ptr: int, flags: int) -> tuple[Any, ...]:
    return _OK, ptr
