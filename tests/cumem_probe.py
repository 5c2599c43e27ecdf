"""Attach by cuMem handle, map the allocation, print each tensor's digest.

    python tests/cumem_probe.py SOCKET SET_ID

Reads host memory through CPU views and device memory by cuMemcpyDtoH.
Prints {"kinds": [...], "digests": {name: sha256}, "location": "host_numa"
or "device_uuid"} once attached, then holds the lease until stdin closes. Where no GPU exists it
runs against tests/fake_cuda (on PYTHONPATH): the lease, the fd channel,
the import and mapping of the allocation and the CPU views are the
client's own code; only the CUDA views (tests/gpu) need a GPU.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy
import torch

from engramd.demo.child import say
from engramd_client import cudadriver
from engramd_client.config import ClientConfig
from engramd_client.cumem import map_allocation, tensor_at
from engramd_client.fdchannel import collect
from engramd_client.handles import channel_path
from engramd_client.lease import Lease
from engramd_client.pb import engramd_pb2 as pb
from engramd_client.tables import torch_dtype


def _from_device(pointer: int, length: int) -> bytes:
    """`length` bytes of device memory, copied to the host by the driver."""
    data = bytearray(length)
    if length:
        address = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data
        cu = cudadriver.make_current(0)
        cudadriver.check(cu.cuMemcpyDtoH(address, pointer, length), "cuMemcpyDtoH")
    return bytes(data)


def main() -> int:
    socket, set_id = sys.argv[1:3]
    config = ClientConfig(socket=socket)
    request = pb.AttachRequest(
        set_id=set_id, pid=os.getpid(), accept=[pb.HANDLE_KIND_CUMEM], device="cuda:0"
    )
    lease = Lease(config, request)
    attachment = lease.wait_attached(set_id)
    handles = list(attachment.tensors)
    fds = collect(
        channel_path(config, attachment), lease.lease_id, attachment.fd_channel.secret, 10
    )
    try:
        mapped = map_allocation(handles, fds, 0)
    finally:
        for fd in fds.values():
            os.close(fd)
    digests = {}
    for h in handles:
        pointer = mapped.pointer + h.cumem.offset
        data: bytes | memoryview
        if mapped.cpu:
            view = tensor_at(
                pointer, h.cumem.length, torch_dtype(h.dtype), tuple(h.shape), torch.device("cpu")
            )
            data = view.view(torch.uint8).numpy().data
        else:
            data = _from_device(pointer, h.cumem.length)
        digests[h.name] = hashlib.sha256(data).hexdigest()
    say(
        {
            "kinds": sorted({pb.HandleKind.Name(h.kind) for h in handles}),
            "digests": digests,
            "location": handles[0].cumem.WhichOneof("location"),
        }
    )
    sys.stdin.read()
    mapped.release()
    lease.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
