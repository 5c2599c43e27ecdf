"""The CUDA backings where CUDA cannot work, and the cuMem protocol parts that need no GPU.

A daemon asked for cuda-host or cuda-device:N on a machine without a usable
CUDA driver says why, in its log and in status, and serves from auto's
backings (tmpfs, else memfd), where workers with a device register their
own mapping. Where no driver works, tests/support/fake_cuda stands in for the driver, so the
cuda-host backing (allocate, load, check, export, verify, drop) and a
worker's import run for real around it; what needs a GPU (device access,
CUDA views, cuda-device, gathers) is in tests/gpu/test_cuda_handles.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SUPPORT, Worker, wait_until
from engramd.api.requests import attach_intent
from engramd.backings import CudaHostBacking
from engramd.backings.cudacopy import read_only_handle
from engramd.backings.handles import HandleKind
from engramd.cli.status_view import render
from engramd.sets.keeper import SetKeeper
from engramd.testing.child import JsonLinesChild
from engramd.values import BackingSpec
from engramd_client.tables import Tables
from engramd_shared import cudadriver
from engramd_shared.errors import DeviceError, InvalidRequest, NoCpuView
from engramd_shared.pb import engramd_pb2 as pb
from helpers import engramd, reference_digests


def _no_driver() -> str | None:
    """Why this process cannot use CUDA's driver, or None where it can."""
    try:
        cudadriver.driver()
    except DeviceError as e:
        return str(e)
    return None


NO_DRIVER = _no_driver()
#: A CUDA driver over memfds (tests/support/fake_cuda), first on a child's PYTHONPATH.
FAKE_DRIVER = {
    "PYTHONPATH": os.pathsep.join(
        [str(SUPPORT / "fake_cuda"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
}
PROBE = SUPPORT / "cumem_probe.py"


def _probe(d: Any, set_id: str, *extra: str) -> JsonLinesChild:
    """support/cumem_probe.py attaching to `set_id` by cuMem handle, over the simulated driver."""
    command = [sys.executable, str(PROBE), str(d.socket), set_id, *extra]
    return JsonLinesChild(command, env={**os.environ, **FAKE_DRIVER})


needs_no_driver = pytest.mark.skipif(
    NO_DRIVER is None,
    reason="a CUDA driver works here: tests/gpu/test_cuda_handles.py runs the CUDA backings",
)


@needs_no_driver
@pytest.mark.parametrize("backing", ["cuda-host", "cuda-device:1"])
def test_a_cuda_backing_that_cannot_work_here_says_why_and_auto_stands_in(
    backing: str, checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--backing", backing, "--checkpoint", str(checkpoint))
    status = d.status()
    assert [b.name for b in status.backings] == ["tmpfs", "memfd"]
    for b in status.backings:
        assert (b.stands_in_for, b.reason) == (backing, NO_DRIVER)
    [s] = status.sets
    assert (s.backing, s.state) == ("tmpfs", "ready")
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert w.hello["digests"] == reference_digests(checkpoint)
    assert d.log.count(f"--backing {backing} cannot be used here ({NO_DRIVER})") == 1

    text = render(status)
    assert f"--backing {backing} cannot be used here: {NO_DRIVER}; tmpfs/memfd stand in" in text
    shown = engramd("status", "--socket", str(d.socket), "--json")
    assert shown.returncode == 0
    assert {b["stands_in_for"] for b in json.loads(shown.stdout)["backings"]} == {backing}


def test_cuda_device_takes_a_device_index() -> None:
    assert BackingSpec.parse("cuda-device") == BackingSpec("cuda-device")
    assert BackingSpec.parse("cuda-device:3") == BackingSpec("cuda-device", 3)
    assert str(BackingSpec.parse("cuda-device:3")) == "cuda-device:3"
    for text in ("cuda-device:x", "memfd:1"):
        with pytest.raises(ValueError, match="as cuda-device:N"):
            BackingSpec.parse(text)
    with pytest.raises(ValueError, match="'nvme' is not a backing"):
        BackingSpec.parse("nvme")
    refused = engramd("serve", "--backing", "cuda-device:gpu1", "--socket", "/nonexistent/s")
    assert refused.returncode == 2
    assert "cuda-device:N" in refused.stderr


def test_a_worker_without_a_device_is_told_to_ask_for_one() -> None:
    # A cuMem backing as the service sees it: its name and handle kinds (no GPU here).
    class CuMemOnly:
        name = CudaHostBacking.name
        handle_kinds = frozenset({HandleKind.CUMEM})

    cpu_only = attach_intent(
        pb.AttachRequest(set_id="0" * 20, accept=[pb.HANDLE_KIND_FD, pb.HANDLE_KIND_SHM])
    )
    with pytest.raises(InvalidRequest, match=r"device='cuda:N' \(ENGRAMD_DEVICE\)"):
        SetKeeper._handle_kind(cpu_only, [CuMemOnly()])  # type: ignore[list-item]
    with_device = attach_intent(
        pb.AttachRequest(
            set_id="0" * 20, accept=[pb.HANDLE_KIND_CUMEM_FABRIC, pb.HANDLE_KIND_CUMEM]
        )
    )
    # The first kind the worker accepts that the backing has: no fabric handle here.
    assert SetKeeper._handle_kind(with_device, [CuMemOnly()]) is HandleKind.CUMEM  # type: ignore[list-item]


def test_tables_of_a_device_only_set_name_the_cuda_view() -> None:
    # CPU tensors stand in for the CUDA views a cuda-device import gives.
    views = {"a": torch.arange(6, dtype=torch.float32).view(3, 2), "b": torch.zeros(0)}
    released: list[bool] = []
    tables = Tables({}, mode="shared", set_id="0" * 20)
    tables.set_views(views, 1, lambda: released.append(True))
    assert list(tables) == ["a", "b"] and len(tables) == 2 and "a" in tables
    assert tables.device == torch.device("cuda", 1) and tables.nbytes == 24
    assert tables.cuda("a") is views["a"]
    with pytest.raises(NoCpuView, match=r"lives in GPU memory .* use tables.cuda\('a'\)"):
        tables["a"]
    with pytest.raises(KeyError):
        tables["c"]
    with pytest.raises(ValueError, match="CUDA views on cuda:1 already"):
        tables.set_views(views, 1, lambda: None)
    tables.close()
    tables.close()
    assert released == [True] and list(tables) == []


def test_allocation_properties_and_access_as_the_driver_reads_them() -> None:
    import ctypes

    from cuda.bindings import driver as cu

    host = cudadriver.allocation_prop(cu, 1, 0, fabric=False)
    assert host.type == cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert (host.location.type, host.location.id) == (
        cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA,
        1,
    )
    fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    assert host.requestedHandleTypes == fd
    on_gpu = cudadriver.allocation_prop(cu, None, 2, fabric=True)
    assert (on_gpu.location.type, on_gpu.location.id) == (
        cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
        2,
    )
    # Both handle types: the mask the binding cannot hold, where cuda.h puts it.
    fabric = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    mask = ctypes.c_int.from_address(on_gpu.getPtr() + 4).value
    assert mask == int(fd) | int(fabric)

    read = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    [device] = cudadriver.access(cu, 3, cpu=False)
    assert (device.location.id, device.flags) == (3, read)
    device, cpu = cudadriver.access(cu, 0, cpu=True, writable=True)
    assert cpu.location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    assert {device.flags, cpu.flags} == {cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE}


@needs_no_driver
def test_cuda_host_allocates_checks_and_exports_its_set_over_a_simulated_driver(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint), env=FAKE_DRIVER)
    # The set is served once ready and locked after (locking must not delay readiness).
    wait_until(lambda: d.status().sets[0].locked, 30, "the set to be locked")
    status = d.status()
    [b] = status.backings
    assert (b.name, b.stands_in_for, b.survives_restart) == ("cuda-host", "", False)
    assert b.page_size == 2 << 20  # the driver's granularity
    [s] = status.sets
    assert (s.backing, s.state, s.locked, s.page_size) == ("cuda-host", "ready", True, 2 << 20)

    probes = [_probe(d, s.set_id) for _ in range(2)]
    expected = {
        "kinds": ["HANDLE_KIND_CUMEM"],
        "digests": reference_digests(checkpoint),
        "location": "host_numa",
    }
    assert [p.read() for p in probes] == [expected, expected]
    [s] = d.status().sets
    assert [(lease.kind, lease.device) for lease in s.leases] == [
        (pb.HANDLE_KIND_CUMEM, "cuda:0")
    ] * 2

    assert "cuda-host sets: cuMem allocations on host NUMA node 0" in d.log

    # A worker without a device is told to ask for one, and loads privately meanwhile.
    cpu_only = Worker(checkpoint, d.socket)
    assert cpu_only.hello["mode"] == "private"
    assert "attach with device='cuda:N'" in cpu_only.hello["reason"]
    assert cpu_only.hello["digests"] == expected["digests"]
    assert cpu_only.exit() == 0

    # Killed, the daemon takes its allocation along but not the workers' imports; the next
    # one loads a new copy, and their leases come back marked stale.
    d.stop(signal.SIGKILL)
    d.start()
    wait_until(
        lambda: [lease.stale for lease in d.status().sets[0].leases] == [True, True],
        30,
        "both leases back, stale",
    )
    assert not d.status().sets[0].adopted

    socket = ("--socket", str(d.socket))
    checked = engramd("verify", s.set_id, *socket)
    assert checked.returncode == 0 and "all 4 tensors match" in checked.stdout
    dropped = engramd("drop", "--force", s.set_id, *socket)
    assert dropped.returncode == 0, dropped.stderr
    assert list(d.status().sets) == []
    for p in probes:
        assert p.proc.stdin is not None
        p.proc.stdin.close()
        assert p.proc.wait(timeout=30) == 0, "the imports outlive the daemon and the drop"
    assert "Traceback" not in d.log


@needs_no_driver
def test_cuda_device_copies_its_set_to_the_device_and_back_over_a_simulated_driver(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--backing", "cuda-device:0", "--checkpoint", str(checkpoint), env=FAKE_DRIVER)
    status = d.status()
    [b] = status.backings
    assert (b.name, b.stands_in_for) == ("cuda-device", "")
    assert b.where == "cuda:0 GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"  # the driver's UUID
    [s] = status.sets
    assert (s.backing, s.state) == ("cuda-device", "ready")

    probe = _probe(d, s.set_id)
    # Loaded by cuMemcpyHtoD, checked and read back by cuMemcpyDtoH: the checkpoint's bytes.
    assert probe.read() == {
        "kinds": ["HANDLE_KIND_CUMEM"],
        "digests": reference_digests(checkpoint),
        "location": "device_uuid",
    }
    checked = engramd("verify", s.set_id, "--socket", str(d.socket))
    assert checked.returncode == 0 and "all 4 tensors match" in checked.stdout
    assert probe.proc.stdin is not None
    probe.proc.stdin.close()
    assert probe.proc.wait(timeout=30) == 0
    assert "Traceback" not in d.log


@needs_no_driver
def test_cuda_host_hands_workers_read_only_access_only(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint), env=FAKE_DRIVER)
    [s] = d.status().sets
    attacker = _probe(d, s.set_id, "attack")
    assert attacker.read()["digests"] == reference_digests(checkpoint)
    attack = attacker.read()["attack"]
    assert attack["descriptor"] == "read-only"
    assert attack["mmap_write"] == "PermissionError"
    assert attack["perms"].startswith("r-")
    assert attack["set_access_read_write"].startswith("cuMemSetAccess failed: CUDA error")
    assert attack["store"] == "SIGSEGV"  # the import's CPU view is PROT_READ
    # Every other worker still reads the checkpoint's bytes.
    checked = engramd("verify", s.set_id, "--socket", str(d.socket))
    assert checked.returncode == 0 and "all 4 tensors match" in checked.stdout
    reader = _probe(d, s.set_id)
    assert reader.read()["digests"] == reference_digests(checkpoint)
    for p in (attacker, reader):
        assert p.proc.stdin is not None
        p.proc.stdin.close()
        assert p.proc.wait(timeout=30) == 0


@needs_no_driver
def test_a_driver_that_crashes_in_cumemcreate_is_tried_in_a_child_and_tmpfs_stands_in(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    env = {**FAKE_DRIVER, "FAKE_CUDA_FAULTS": "crash-in-cumemcreate"}
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint), env=env)
    status = d.status()
    assert [b.name for b in status.backings] == ["tmpfs", "memfd"]
    reason = status.backings[0].reason
    assert reason.startswith("a trial cuMem allocation on host NUMA node 0 crashed the process")
    assert "SIGSEGV" in reason and "r595" in reason
    assert f"--backing cuda-host cannot be used here: {reason}" in render(status)
    [s] = status.sets
    assert (s.backing, s.state) == ("tmpfs", "ready")
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["digests"] == reference_digests(checkpoint)


@needs_no_driver
def test_read_only_cpu_access_refused_keeps_the_daemons_mapping_read_write_and_says_so(
    checkpoint: Path, daemons: Any
) -> None:
    env = {**FAKE_DRIVER, "FAKE_CUDA_FAULTS": "no-read-only-cpu"}
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint), env=env)
    [b] = d.status().backings
    assert (b.name, b.stands_in_for) == ("cuda-host", "")
    assert "the driver refuses read-only CPU access to host memory" in d.log
    [s] = d.status().sets
    assert s.state == "ready"
    checked = engramd("verify", s.set_id, "--socket", str(d.socket))
    assert checked.returncode == 0 and "all 4 tensors match" in checked.stdout


def test_fabric_handles_go_to_the_real_bindings_as_an_address() -> None:
    from cuda.bindings import driver as cu

    fabric = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    # The structure itself is refused by cuda-bindings 13: mapped to DeviceError naming the call.
    with pytest.raises(DeviceError, match=r"^import \(fabric\) failed: TypeError: .*Buffer"):
        cudadriver.call(
            "import (fabric)", cu.cuMemImportFromShareableHandle, cu.CUmemFabricHandle(), fabric
        )
    # Its address is taken: what is left to fail here is the missing driver, not the argument.
    with pytest.raises(DeviceError, match=r"cuMemImportFromShareableHandle \(fabric\)") as e:
        cudadriver.import_handle(cu, None, bytes(range(64)))
    assert "Buffer Protocol" not in str(e.value)
    if NO_DRIVER is not None:
        assert "TypeError" not in str(e.value)


def test_a_worker_cannot_open_its_cuda_host_descriptor_again_for_writing() -> None:
    """The read-only descriptor of a file export stays read-only through /proc/self/fd."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another user needs root")
    exported = os.memfd_create("allocation")
    os.ftruncate(exported, 4096)
    handed_out = read_only_handle(exported)
    pid = os.fork()
    if pid == 0:  # a worker of another uid holding the descriptor it was sent
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            # A changed uid makes a process undumpable, which alone would close
            # /proc/self/fd to it: made dumpable again, only the file's mode judges.
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            try:
                os.open(f"/proc/self/fd/{handed_out}", os.O_RDWR)
                code = 1
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.close(handed_out)
    assert os.waitstatus_to_exitcode(status) == 0, "the descriptor opened again read-write"
