"""Attach by cuMem handle, map the allocation, print each tensor's digest.

    python tests/support/cumem_probe.py SOCKET SET_ID [attack]

Reads host memory through CPU views and device memory by cuMemcpyDtoH.
Prints {"kinds": [...], "digests": {name: sha256}, "location": "host_numa"
or "device_uuid"} once attached, then holds the lease until stdin closes. Where no GPU exists it
runs against tests/support/fake_cuda (on PYTHONPATH): the lease, the fd channel,
the import and mapping of the allocation and the CPU views are the
client's own code; only the CUDA views (tests/gpu) need a GPU.

With "attack" it also tries to change the set, as a hostile worker would,
and prints {"attack": {...}} with what each try met: the descriptor's
access mode, a PROT_WRITE mapping of it, read-write access to its import
(cuMemSetAccess), and a store through the import's CPU view (in a forked
child, which dies of the fault).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import signal
import sys

import numpy
import torch

from engramd.testing.child import say
from engramd_client.cumem import map_allocation, tensor_at
from engramd_client.fdchannel import collect
from engramd_client.handles import channel_path
from engramd_client.lease import Lease
from engramd_client.mapping import torch_dtype
from engramd_shared import cudadriver
from engramd_shared.config import ClientConfig
from engramd_shared.cudadriver import Mapped
from engramd_shared.errors import DeviceError
from engramd_shared.pb import engramd_pb2 as pb


def _from_device(pointer: int, length: int) -> bytes:
    """`length` bytes of device memory, copied to the host by the driver."""
    data = bytearray(length)
    if length:
        address = numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data
        cu = cudadriver.make_current(0)
        cudadriver.call("cuMemcpyDtoH", cu.cuMemcpyDtoH, address, pointer, length)
    return bytes(data)


def _perms(address: int) -> str:
    """The permissions /proc/self/maps shows for the mapping at `address` ("" if none)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms
    return ""


def _attack(fds: dict[str, int], mapped: Mapped) -> dict[str, str]:
    """Try to write the daemon's allocation every way a worker holds it; what each met."""
    (fd,) = fds.values()
    modes = {os.O_RDONLY: "read-only", os.O_WRONLY: "write-only", os.O_RDWR: "read-write"}
    met = {"descriptor": modes[fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE]}
    try:
        mmap.mmap(fd, mapped.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        met["mmap_write"] = "mapped"
    except OSError as e:
        met["mmap_write"] = type(e).__name__
    met["perms"] = _perms(mapped.pointer)
    # The store first: a read-write grant that follows must not let it through.
    pid = os.fork()
    if pid == 0:
        ctypes.memset(mapped.pointer, 0xFF, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    met["store"] = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else "stored"
    cu = cudadriver.make_current(0)
    try:
        cudadriver.set_access(cu, mapped.pointer, mapped.size, 0, True, writable=True)
        met["set_access_read_write"] = "granted"
    except DeviceError as e:
        met["set_access_read_write"] = str(e)
    return met


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
        attack = _attack(fds, mapped) if sys.argv[3:] == ["attack"] else None
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
    if attack is not None:
        say({"attack": attack})
    sys.stdin.read()
    mapped.release()
    lease.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
