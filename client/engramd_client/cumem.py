"""cuMem allocations shared by handle: the driver calls of both sides, and the worker's import.

The cuda-host and cuda-device backings (engramd/backings/cuda.py) hold each
set in one cuMem allocation: pinned host memory on a NUMA node, or memory
of one GPU. The daemon exports it as a POSIX file descriptor (collected on
the fd channel) or a FABRIC handle (in the reply); a worker imports it:

    cuMemImportFromShareableHandle -> cuMemAddressReserve -> cuMemMap
    -> cuMemSetAccess (its device reads; the CPU reads host memory)

and views each tensor at its offset, on the device (UVA: the mapped address
is valid there) and, for host memory, on the CPU. No page is pinned or
copied by the worker: the daemon's allocation is already pinned, so the
attach should not grow with the set's size the way cudaHostRegister of a
shm mapping does (bench/cumem.py measures both on a GPU).

A worker's import holds its own reference to the allocation: it stays
mapped and readable when the daemon exits, until the worker closes it.

The driver calls are in cudadriver.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engramd_client.mapping import Region, RowRanges, torch_dtype
from engramd_shared.cudadriver import (
    Mapped,
    call,
    device_index,
    granularity,
    import_handle,
    make_current,
    map_handle,
)
from engramd_shared.errors import DeviceError
from engramd_shared.pb import engramd_pb2 as pb

log = logging.getLogger("engramd_client")


def tensor_at(
    pointer: int, length: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A tensor on `device` over `length` bytes at `pointer`, mapped by its owner (no copy).

    The device is given, never inferred from the pointer. torch's CUDA array
    interface asks the driver which device a pointer belongs to
    (cudaPointerGetAttributes), an answer host memory need not give as the
    worker's cuda:N, and it needs numpy to read the interface's typestr. A
    storage over the address on the stated device is what torch builds for
    memory it did not allocate itself (its CUDA graph trees do the same); it
    owns nothing, so the caller unmaps only after the tensor's last use.
    """
    if length == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    storage = torch._C._construct_storage_from_data_pointer(pointer, device, length)
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return flat.view(dtype).view(shape)


@dataclass
class ImportedSet:
    """A set's cuMem allocation imported and mapped in this worker, and its tensors' views."""

    mapped: Mapped
    #: CPU tensors (host memory), by name; empty for device memory.
    cpu: dict[str, torch.Tensor]
    #: Tensors on the worker's device, by name.
    cuda: dict[str, torch.Tensor]

    def release(self) -> None:
        """Drop the views and unmap (the views must not be used after)."""
        self.cpu, self.cuda = {}, {}
        self.mapped.release()


def map_allocation(
    handles: list[pb.TensorHandle], descriptors: dict[str, int], index: int
) -> Mapped:
    """Import and map the one allocation `handles` (oneof cumem) point into, for device `index`.

    `descriptors`: the fd channel's descriptors by file name (POSIX fd
    handles); the caller closes them. The CPU may read host memory too.
    """
    sources = {(h.cumem.file, h.cumem.fabric, h.cumem.size) for h in handles}
    if len(sources) != 1:
        raise DeviceError(f"engramd handed out {len(sources)} cuMem allocations for one set")
    ((file, fabric, size),) = sources
    first = handles[0].cumem
    cpu = first.WhichOneof("location") == "host_numa"
    cu = make_current(index)
    if not cpu and device_index(cu, first.device_uuid) is None:
        raise DeviceError(
            f"the set lives on GPU {first.device_uuid}, which this process does not see "
            "(CUDA_VISIBLE_DEVICES); run the worker with that GPU visible"
        )
    fd = None
    if not fabric:
        fd = descriptors.get(file)
        if fd is None:
            raise DeviceError(f"engramd sent no descriptor for the allocation {file!r}")
    handle = import_handle(cu, fd, fabric)
    try:
        prop = call(
            "cuMemGetAllocationPropertiesFromHandle",
            cu.cuMemGetAllocationPropertiesFromHandle,
            handle,
        )
        align = granularity(cu, prop)
    except BaseException:
        call("cuMemRelease", cu.cuMemRelease, handle)
        raise
    try:
        mapped = map_handle(cu, handle, size, align, index, cpu)
    except DeviceError as e:
        raise DeviceError(
            f"{e}: cuda:{index} cannot map engramd's allocation"
            + ("" if cpu else f" on GPU {first.device_uuid} (no peer access to it?)")
        ) from None
    if cpu and not mapped.read_only:
        log.warning(
            "the CUDA driver refuses read-only CPU access to engramd's host memory, so this "
            "worker maps it read-write: a write through its tables would change what every "
            "worker reads"
        )
    return mapped


def import_set(
    handles: list[pb.TensorHandle],
    descriptors: dict[str, int],
    index: int,
    rows: RowRanges | None = None,
) -> ImportedSet:
    """The set's allocation mapped for device `index` (map_allocation), viewed tensor by tensor.

    CUDA views of every tensor, and CPU views where the allocation is host
    memory; `rows` cuts the views to row ranges.
    """
    mapped = map_allocation(handles, descriptors, index)
    imported = ImportedSet(mapped, {}, {})
    where = "cuMem fabric" if handles[0].cumem.fabric else f"cuMem {handles[0].cumem.file}"
    try:
        for h in handles:
            c = h.cumem
            region = Region(h.name, h.dtype, tuple(h.shape), where, c.offset, c.length).cut(rows)
            if region.offset + region.length > mapped.size:
                raise DeviceError(
                    f"tensor {h.name!r} lies outside engramd's {mapped.size}-byte allocation"
                )
            dtype = torch_dtype(region.dtype)
            pointer = mapped.pointer + region.offset
            at = (pointer, region.length, dtype, region.shape)
            imported.cuda[h.name] = tensor_at(*at, torch.device("cuda", index))
            if mapped.cpu:
                imported.cpu[h.name] = tensor_at(*at, torch.device("cpu"))
    except BaseException:
        imported.release()
        raise
    return imported
