"""CUDA views of a worker's tables: the same host pages, registered with the driver (UVA).

A GPU reads Engram rows straight from host memory: the pages must be
page-locked and mapped for the device. `torch.Tensor.pin_memory()` would
copy each table into torch's pinned caching allocator, which rounds a block
up to a power of two (a 94.4 GiB table takes 128 GiB). Instead each
tensor's own mapping (the daemon's shared pages, or a private copy of
exactly its size) is registered in place with cudaHostRegister:

- flags: mapped (a device pointer exists), portable (every context sees
  it), and read-only for a shared mapping (PROT_READ pages cannot be pinned
  for writing; the device attribute HostRegisterReadOnlySupported says
  whether the driver can);
- the route is decided before the attach by what the device says
  (device_caps): read-only registration where supported; else reads
  through the host's page tables where the device uses them (nothing is
  registered); else the daemon's cuMem set if it serves one, a writable
  shared mapping registered with flags 0 where the daemon allows it
  (--allow-writable-gpu-mappings), or a private copy (share.py decides);
- in chunks of at most REGISTER_CHUNK bytes: drivers refuse very large
  single registrations;
- the device view is made at the pointer the driver returns
  (cudaHostGetDevicePointer), which is the host pointer itself where the
  device can use host pointers for registered memory.

A set of engramd's cuda-host or cuda-device backing needs none of this: it
comes already pinned, by cuMem handle (cumem.py).

The CUDA calls go through NVIDIA's cuda-bindings (`pip install
cuda-bindings`, engramd-node's `[cuda]` extra), imported only when a device
is asked for. A view is a torch tensor on cuda:N over the device pointer,
without a copy (cumem.tensor_at).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engramd_client.cumem import tensor_at
from engramd_shared.cudadriver import bindings, call
from engramd_shared.errors import DeviceError
from engramd_shared.pb import engramd_pb2 as pb

#: The most bytes one cudaHostRegister call is given (vLLM met a 512 GiB cap).
REGISTER_CHUNK = 64 << 30
#: Registrations start and end on page boundaries.
PAGE = 4096

# cudaHostRegister flags (cuda_runtime_api.h); fixed by the CUDA ABI.
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08

#: How a worker's device reads its tables (Tables.gpu_route), by the daemon's name for it.
ROUTES: dict[int, str] = {
    pb.GPU_ROUTE_CUMEM_IMPORT: "cumem-import",
    pb.GPU_ROUTE_REGISTER_READ_ONLY: "registered-read-only",
    pb.GPU_ROUTE_HOST_PAGE_TABLES: "host-page-tables",
    pb.GPU_ROUTE_REGISTER_WRITABLE: "registered-writable",
}
#: A private copy of the tables, registered (writable: it is this process's memory).
PRIVATE_ROUTE = "private-registered"

FIX_CUDA = (
    "install a CUDA build of torch and NVIDIA's bindings (pip install cuda-bindings, "
    "engramd-node's [cuda] extra), "
    "or attach without device= (ENGRAMD_DEVICE unset) for CPU tensors"
)


def parse_device(text: str) -> int | None:
    """The CUDA device index of "cuda:N" ("cuda": 0); None for "" (CPU tensors only)."""
    text = text.strip()
    if not text:
        return None
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise DeviceError(f"device={text!r}: use cuda:N (N a CUDA device index), or nothing")
    return device.index or 0


def chunks(address: int, length: int, limit: int = REGISTER_CHUNK) -> list[tuple[int, int]]:
    """(start, bytes) of each registration covering [address, address + length).

    The range is widened to whole pages; each chunk holds at most `limit`
    bytes (a multiple of the page) and starts where the previous one ended.
    """
    if length <= 0:
        return []
    if limit < PAGE or limit % PAGE:
        raise ValueError(f"a chunk limit of {limit} bytes is not a whole number of pages")
    start = address - address % PAGE
    end = -(-(address + length) // PAGE) * PAGE
    return [(at, min(limit, end - at)) for at in range(start, end, limit)]


def register_flags(read_only: bool) -> int:
    """cudaHostRegister flags for a mapping: mapped, portable, and read-only where asked."""
    flags = HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE
    return (flags | HOST_REGISTER_READ_ONLY) if read_only else flags


def _runtime() -> Any:
    """cuda-bindings' runtime module; DeviceError naming the extra where it is missing."""
    rt = bindings("runtime")
    if rt is None:
        raise DeviceError(
            f"CUDA views need NVIDIA's cuda-bindings, which is not installed; {FIX_CUDA}"
        )
    return rt


def check_device(index: int) -> None:
    """Raise DeviceError unless torch sees CUDA device `index` and cuda-bindings is installed."""
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device='cuda:{index}' needs CUDA, and this torch {torch.__version__} sees no CUDA "
            f"device; {FIX_CUDA}"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device='cuda:{index}': this process sees {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES?); use cuda:0 to cuda:{count - 1}"
        )
    _runtime()


@dataclass
class Registration:
    """One tensor's mapping registered with CUDA, and its device view."""

    chunks: list[tuple[int, int]]
    #: The tensor on the device, aliasing the host pages.
    view: torch.Tensor

    def release(self) -> None:
        """Unregister the chunks; the device view must not be used after."""
        rt = _runtime()
        for start, _ in self.chunks:
            call("cudaHostUnregister", rt.cudaHostUnregister, start)
        self.chunks = []


def _attribute(rt: Any, name: str, index: int) -> int:
    attr = getattr(rt.cudaDeviceAttr, name, None)
    if attr is None:  # a runtime older than the attribute: the device cannot say yes
        return 0
    return int(call(f"cudaDeviceGetAttribute({name})", rt.cudaDeviceGetAttribute, attr, index))


@dataclass(frozen=True)
class DeviceCaps:
    """What a device says about reading host memory it did not allocate."""

    #: cudaDevAttrHostRegisterReadOnlySupported: read-only mappings can be registered.
    read_only_register: bool
    #: cudaDevAttrPageableMemoryAccessUsesHostPageTables: the device reads any host
    #: memory through the CPU's page tables (ATS), read-only mappings included.
    host_page_tables: bool

    def route(self) -> int:
        """The route (engramd.v1.GpuRoute) for a read-only shared mapping on this device.

        GPU_ROUTE_REGISTER_WRITABLE: neither works, so the worker asks the daemon
        for writable descriptors (granted only with --allow-writable-gpu-mappings).
        """
        if self.read_only_register:
            return pb.GPU_ROUTE_REGISTER_READ_ONLY
        if self.host_page_tables:
            return pb.GPU_ROUTE_HOST_PAGE_TABLES
        return pb.GPU_ROUTE_REGISTER_WRITABLE


def device_caps(index: int) -> DeviceCaps:
    """Read device `index`'s answers before anything is registered (DeviceError on failure)."""
    rt = _runtime()
    return DeviceCaps(
        read_only_register=bool(_attribute(rt, "cudaDevAttrHostRegisterReadOnlySupported", index)),
        host_page_tables=bool(
            _attribute(rt, "cudaDevAttrPageableMemoryAccessUsesHostPageTables", index)
        ),
    )


def register(tensor: torch.Tensor, index: int, route: str) -> Registration:
    """A CPU tensor's pages made readable by device `index` in place, by `route`; no copy.

    registered-read-only: cudaHostRegister with the read-only flag (the
    worker's read-only mapping); registered-writable and private-registered:
    flags 0 beyond mapped and portable (a writable mapping); host-page-tables:
    nothing is registered, the device reads the pages at their address.
    """
    rt = _runtime()
    device = torch.device("cuda", index)
    length = tensor.numel() * tensor.element_size()
    if length == 0:
        return Registration([], tensor_at(0, 0, tensor.dtype, tuple(tensor.shape), device))
    call(f"cudaSetDevice({index})", rt.cudaSetDevice, index)
    if route == ROUTES[pb.GPU_ROUTE_HOST_PAGE_TABLES]:
        view = tensor_at(tensor.data_ptr(), length, tensor.dtype, tuple(tensor.shape), device)
        return Registration([], view)
    read_only = route == ROUTES[pb.GPU_ROUTE_REGISTER_READ_ONLY]
    if read_only and not _attribute(rt, "cudaDevAttrHostRegisterReadOnlySupported", index):
        raise DeviceError(
            f"cuda:{index} cannot register read-only host memory (a driver or device without "
            "cudaHostRegisterReadOnly), and the shared tables are mapped read-only; attach with "
            "share=False for private tables on the device"
        )
    planned = chunks(tensor.data_ptr(), length)
    uses_host_pointer = bool(_attribute(rt, "cudaDevAttrCanUseHostPointerForRegisteredMem", index))
    if len(planned) > 1 and not uses_host_pointer:
        # Separate registrations need not be contiguous on the device.
        raise DeviceError(
            f"a tensor of {length} bytes needs {len(planned)} registrations, and cuda:{index} "
            "cannot use host pointers for registered memory, so they would not form one view"
        )
    registration = Registration([], tensor)
    try:
        for start, size in planned:
            call(
                f"cudaHostRegister of {size} bytes on cuda:{index}",
                rt.cudaHostRegister,
                start,
                size,
                register_flags(read_only),
            )
            registration.chunks.append((start, size))
        pointer = tensor.data_ptr()
        if not uses_host_pointer:
            pointer = call(
                "cudaHostGetDevicePointer", rt.cudaHostGetDevicePointer, tensor.data_ptr(), 0
            )
    except BaseException:
        registration.release()
        raise
    registration.view = tensor_at(int(pointer), length, tensor.dtype, tuple(tensor.shape), device)
    return registration


def register_all(
    tensors: dict[str, torch.Tensor], index: int, route: str
) -> dict[str, Registration]:
    """Every tensor registered for device `index`; nothing stays registered on failure."""
    done: dict[str, Registration] = {}
    try:
        for name, tensor in tensors.items():
            done[name] = register(tensor, index, route)
    except BaseException:
        for registration in done.values():
            registration.release()
        raise
    return done
