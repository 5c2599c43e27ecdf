"""A trial of the cuMem calls a CUDA backing makes, in a child process, before the daemon uses it.

Attributes say what a device claims; some drivers crash in the first real
call (cuMemCreate on HOST_NUMA memory kills the process on r560-r580
drivers, NCCL #2106) or refuse it (a VM's NUMA layout). So one granule is
created, mapped, exported, written, read back, made read-only and
released in a child:

    python -m engramd.backings.cudaprobe DEVICE HOST_NUMA|- FABRIC(0|1)

prints one JSON line, {"cpu_read_only": true|false}, and exits 0; or prints
the DeviceError on stderr and exits 1. `trial` runs it and turns a crash, a
hang or an error into a DeviceError naming the cause, so the daemon says
"cannot be used here" and tmpfs/memfd stand in, as for a missing driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from typing import Any

from engramd_shared import cudadriver
from engramd_shared.errors import DeviceError

#: Longest a trial may take: a driver that hangs is as unusable as one that crashes.
TRIAL_TIMEOUT_S = 60.0
#: What the trial writes and reads back.
_PATTERN = bytes(range(256)) * 16


def trial(device: int, host_numa: int | None, fabric: bool) -> bool:
    """Run the trial in a child; True where the driver grants read-only CPU access.

    Raises DeviceError naming why the allocation cannot be used here.
    """
    command = [
        sys.executable,
        "-m",
        __name__,
        str(device),
        "-" if host_numa is None else str(host_numa),
        str(int(fabric)),
    ]
    where = f"host NUMA node {host_numa}" if host_numa is not None else f"cuda:{device}"
    what = f"a trial cuMem allocation on {where}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DeviceError(f"{what} did not finish within {TRIAL_TIMEOUT_S:.0f} s") from None
    said = done.stderr.strip().splitlines()
    last = said[-1] if said else ""
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise DeviceError(
            f"{what} crashed the process in the driver ({name})"
            + (f": {last}" if last else "")
            + "; a driver of r595 or later fixes host-NUMA cuMemCreate crashes (NCCL #2106)"
        )
    if done.returncode:
        raise DeviceError(f"{what} failed: {last or f'exit status {done.returncode}'}")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return bool(answer["cpu_read_only"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise DeviceError(f"{what} gave no answer ({done.stdout[-200:]!r})") from None


def _run(device: int, host_numa: int | None, fabric: bool) -> bool:
    """The trial itself (in the child): True where read-only CPU access was granted."""
    cu = cudadriver.make_current(device)
    host = host_numa is not None
    prop = cudadriver.allocation_prop(cu, host_numa, device, fabric)
    size = cudadriver.granularity(cu, prop)
    handle = cudadriver.call(f"cuMemCreate of {size} bytes", cu.cuMemCreate, size, prop, 0)
    mapped = cudadriver.map_handle(cu, handle, size, size, device, host, writable=True)
    try:
        types = cu.CUmemAllocationHandleType
        exported = cudadriver.call(
            "cuMemExportToShareableHandle (fd)",
            cu.cuMemExportToShareableHandle,
            handle,
            types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
        os.close(int(exported))
        if fabric:
            cudadriver.call(
                "cuMemExportToShareableHandle (fabric)",
                cu.cuMemExportToShareableHandle,
                handle,
                types.CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        _write(cu, mapped.pointer, host)
        read_only = cudadriver.set_access(cu, mapped.pointer, size, device, host, writable=False)
        found = _read(cu, mapped.pointer, host)
        if found != _PATTERN:
            raise DeviceError(f"{len(_PATTERN)} bytes written read back different")
        return read_only
    finally:
        mapped.release()


def _write(cu: Any, pointer: int, host: bool) -> None:
    source = ctypes.create_string_buffer(_PATTERN, len(_PATTERN))
    if host:
        ctypes.memmove(pointer, source, len(_PATTERN))
    else:
        address = ctypes.addressof(source)
        cudadriver.call("cuMemcpyHtoD", cu.cuMemcpyHtoD, pointer, address, len(_PATTERN))


def _read(cu: Any, pointer: int, host: bool) -> bytes:
    if host:
        return ctypes.string_at(pointer, len(_PATTERN))
    target = ctypes.create_string_buffer(len(_PATTERN))
    address = ctypes.addressof(target)
    cudadriver.call("cuMemcpyDtoH", cu.cuMemcpyDtoH, address, pointer, len(_PATTERN))
    return target.raw


def main(argv: list[str]) -> int:
    """The child's entry: run the trial, print its answer (or the error on stderr)."""
    device, node, fabric = argv
    try:
        read_only = _run(int(device), None if node == "-" else int(node), fabric == "1")
    except DeviceError as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps({"cpu_read_only": read_only}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
