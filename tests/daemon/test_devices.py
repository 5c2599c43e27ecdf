"""Everything around the CUDA calls that runs without a GPU: devices, chunks, flags, errors.

The registrations themselves run in tests/gpu/ (make test-gpu) where a CUDA
device exists.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from conftest import SUPPORT
from engramd.cli.status_view import render
from engramd.testing.child import JsonLinesChild
from engramd_client import ClientConfig, DeviceError, attach
from engramd_client.cuda import (
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    HOST_REGISTER_READ_ONLY,
    REGISTER_CHUNK,
    chunks,
    parse_device,
    register_flags,
)
from engramd_client.cumem import tensor_at
from engramd_shared.errors import NoGpuRoute
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import attach_error, engramd, reference_digests

GiB = 1 << 30


def test_devices_are_parsed_as_torch_names_them() -> None:
    assert parse_device("") is None
    assert parse_device("cuda") == 0
    assert parse_device(" cuda:3 ") == 3
    for bad in ("cpu", "gpu:0", "cuda:x", "meta"):
        with pytest.raises(DeviceError, match="use cuda:N"):
            parse_device(bad)
    assert ClientConfig.from_env({"ENGRAMD_DEVICE": "cuda:1"}).device == "cuda:1"
    assert ClientConfig.from_env({"ENGRAMD_DEVICE": "cuda:1"}, device="").device == ""


def test_registrations_are_planned_in_page_aligned_chunks() -> None:
    assert chunks(3 * 4096 + 100, 10) == [(3 * 4096, 4096)]
    assert chunks(4096, 0) == []
    # 189 GiB, as DeepSeek-V4.1-Flash's tables: three calls of at most 64 GiB.
    base = 1 << 40
    assert chunks(base, 189 * GiB) == [
        (base, 64 * GiB),
        (base + 64 * GiB, 64 * GiB),
        (base + 128 * GiB, 61 * GiB),
    ]
    assert 64 * GiB == REGISTER_CHUNK
    # A range that ends inside a page takes the whole page; none is left out or doubled.
    planned = chunks(base + 5, 2 * 8192, limit=8192)
    assert planned == [(base, 8192), (base + 8192, 8192), (base + 16384, 4096)]
    with pytest.raises(ValueError, match="not a whole number of pages"):
        chunks(base, GiB, limit=5000)


def test_shared_mappings_are_registered_read_only() -> None:
    assert register_flags(read_only=True) == (
        HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY
    )
    assert register_flags(read_only=False) == HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE


def test_views_alias_the_mapping_at_the_address_they_are_given(tmp_path: Path) -> None:
    # tensor_at makes every CUDA view; here it runs on the CPU, over a shared
    # mapping of a file: a view must sit at the address and show later writes.
    path = tmp_path / "table"
    path.write_bytes(bytes(range(256)) * 64)
    with path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as mapping:
        anchor = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(anchor)
        view = tensor_at(address + 4096, 2048, torch.bfloat16, (4, 256), torch.device("cpu"))
        assert view.data_ptr() == address + 4096
        assert (view.dtype, view.shape) == (torch.bfloat16, torch.Size([4, 256]))
        assert view.view(torch.uint8).flatten().tolist() == list(range(256)) * 8
        os.pwrite(file.fileno(), b"\xff\xff", 4096)
        assert view.view(torch.uint8)[0, :4].tolist() == [255, 255, 2, 3]
        empty = tensor_at(0, 0, torch.float32, (0, 8), torch.device("cpu"))
        assert empty.shape == (0, 8)
        del view, anchor


@pytest.mark.parametrize("share", [None, True, False], ids=["auto", "strict", "private"])
def test_a_device_without_cuda_is_a_clear_error_in_every_mode(
    checkpoint: Path, sock_dir: Path, share: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device: the CPU-only error cannot happen here")
    # No daemon at this socket: the device is refused before anything is tried.
    socket = str(sock_dir / "none.sock")
    with pytest.raises(DeviceError, match=r"needs CUDA.*cuda-bindings.*\[cuda\] extra"):
        attach(checkpoint, share=share, socket=socket, device="cuda:0")
    monkeypatch.setenv("ENGRAMD_DEVICE", "cuda:1")
    with pytest.raises(DeviceError, match="device='cuda:1' needs CUDA"):
        attach(checkpoint, share=share, socket=socket)


def test_tables_without_a_device_have_no_cuda_views(checkpoint: Path) -> None:
    with attach(checkpoint, share=False) as tables:
        assert tables.device is None
        with pytest.raises(ValueError, match="attach with device='cuda:N'"):
            tables.cuda("layers.1.engram.embed.weight")


def test_status_shows_the_device_a_lease_registered_for(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    set_id = d.status().sets[0].set_id
    bad = attach_error(d, pb.AttachRequest(set_id=set_id, device="cuda:x"))
    assert bad is not None and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    with d.channel() as ch:
        call = pb_grpc.TableServiceStub(ch).Attach(
            pb.AttachRequest(set_id=set_id, pid=1, device="cuda:1"), timeout=30
        )
        try:
            next(e for e in call if e.WhichOneof("event") == "attached")
            reply = d.status()
            [lease] = reply.sets[0].leases
            assert lease.device == "cuda:1"
            assert "cuda:1" in render(reply)
        finally:
            call.cancel()


#: The simulated driver and runtime (tests/support/fake_cuda) first on a child's PYTHONPATH.
FAKE_CUDA = SUPPORT / "fake_cuda"
ROUTE_PROBE = SUPPORT / "route_probe.py"


def _route(checkpoint: Path, d: Any, share: str, faults: str) -> JsonLinesChild:
    """support/route_probe.py: attach(device="cuda:0") over the simulated driver with `faults`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKE_CUDA), os.environ.get("PYTHONPATH", "")]),
        "FAKE_CUDA_FAULTS": faults,
    }
    command = [sys.executable, str(ROUTE_PROBE), str(checkpoint), str(d.socket), share]
    return JsonLinesChild(command, env=env, stderr=subprocess.PIPE)


def _done(child: JsonLinesChild) -> str:
    """Close the child's stdin, wait for it to exit 0; its stderr."""
    assert child.proc.stdin is not None
    child.proc.stdin.close()
    assert child.proc.wait(timeout=60) == 0
    assert child.proc.stderr is not None
    return child.proc.stderr.read()


def _lease_routes(d: Any) -> list[str]:
    return [pb.GpuRoute.Name(lease.gpu_route) for s in d.status().sets for lease in s.leases]


def test_a_device_that_registers_read_only_memory_registers_the_shared_mapping(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    child = _route(checkpoint, d, "on", "")
    got = child.read()
    assert (got["mode"], got["gpu_route"], got["aliases"]) == (
        "shared",
        "registered-read-only",
        True,
    )
    flags = HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY
    assert got["registered"] == [flags] * 4
    assert got["digests"] == reference_digests(checkpoint)
    assert _lease_routes(d) == ["GPU_ROUTE_REGISTER_READ_ONLY"]
    assert "cuda:0 registered read-only" in render(d.status())
    _done(child)


def test_without_read_only_registration_auto_goes_private_and_strict_refuses(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    auto = _route(checkpoint, d, "auto", "no-read-only-register")
    got = auto.read()
    assert (got["mode"], got["gpu_route"]) == ("private", "private-registered")
    # A private copy is this process's writable memory: registered without the read-only flag.
    assert got["registered"] == [HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE] * 4
    assert got["digests"] == reference_digests(checkpoint)
    warned = _done(auto)
    assert warned.count("cannot register read-only host memory") == 1
    assert "--backing cuda-host" in warned and "--allow-writable-gpu-mappings" in warned

    strict = _route(checkpoint, d, "on", "no-read-only-register")
    refused = strict.read()
    assert refused["error"] == "NoGpuRoute"
    assert "cudaDevAttrHostRegisterReadOnlySupported is 0" in refused["message"]
    assert issubclass(NoGpuRoute, DeviceError)
    _done(strict)
    assert _lease_routes(d) == []


def test_a_device_on_host_page_tables_reads_the_mapping_unregistered(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    child = _route(checkpoint, d, "on", "no-read-only-register,host-page-tables")
    got = child.read()
    assert (got["mode"], got["gpu_route"], got["registered"]) == (
        "shared",
        "host-page-tables",
        [],
    )
    assert got["aliases"] and got["digests"] == reference_digests(checkpoint)
    assert _lease_routes(d) == ["GPU_ROUTE_HOST_PAGE_TABLES"]
    _done(child)


def test_the_opted_in_writable_mapping_is_registered_shown_and_caught_by_verify(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--allow-writable-gpu-mappings")
    assert "--allow-writable-gpu-mappings: workers whose GPU cannot register" in d.log
    child = _route(checkpoint, d, "on", "no-read-only-register")
    got = child.read()
    assert "error" not in got, got
    assert (got["mode"], got["gpu_route"], got["aliases"]) == (
        "shared",
        "registered-writable",
        True,
    )
    assert got["registered"] == [HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE] * 4
    assert got["digests"] == reference_digests(checkpoint)
    status = d.status()
    assert status.daemon.writable_gpu_mappings
    assert _lease_routes(d) == ["GPU_ROUTE_REGISTER_WRITABLE"]
    text = render(status)
    assert "cuda:0 registered writable!" in text and "could change the one copy" in text
    assert "gets writable descriptors of set" in d.log

    # The cost the flag names: the worker can change the one copy, and verify finds it.
    child.send("write")
    written = child.read()["wrote"]
    set_id = status.sets[0].set_id
    checked = engramd("verify", set_id, "--socket", str(d.socket))
    assert checked.returncode != 0 and written in checked.stdout + checked.stderr
    _done(child)


def test_without_read_only_registration_a_cuda_host_set_is_imported(
    checkpoint: Path, daemons: Any
) -> None:
    env = {"PYTHONPATH": str(FAKE_CUDA), "FAKE_CUDA_FAULTS": "no-read-only-register"}
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint), env=env)
    child = _route(checkpoint, d, "on", "no-read-only-register")
    got = child.read()
    assert (got["mode"], got["gpu_route"], got["registered"]) == ("shared", "cumem-import", [])
    assert got["digests"] == reference_digests(checkpoint)
    assert _lease_routes(d) == ["GPU_ROUTE_CUMEM_IMPORT"]
    assert "cuda:0 cumem import" in render(d.status())
    _done(child)
