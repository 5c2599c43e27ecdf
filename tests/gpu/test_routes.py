"""The GPU routes on a real device: what it says decides, and each route reads the right bytes.

The same decisions run on the CPU over the simulated driver in
tests/test_devices.py; here the driver is real. Skipped with the device's
reason where a route cannot exist on it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_views import GPU_ONLY, gathers_match

from engramd.testing.child import JsonLinesChild
from engramd_client import DeviceError, attach
from engramd_client.cuda import device_caps

pytestmark = GPU_ONLY
PROBE = Path(__file__).resolve().parents[1] / "support" / "cumem_probe.py"


def _caps() -> Any:
    return device_caps(0) if torch.cuda.is_available() else None


def test_the_route_follows_what_the_device_says(checkpoint: Path, daemons: Any) -> None:
    caps = _caps()
    d = daemons("--checkpoint", str(checkpoint))
    if caps.read_only_register or caps.host_page_tables:
        with attach(checkpoint, socket=str(d.socket), share=True, device="cuda:0") as tables:
            expected = "registered-read-only" if caps.read_only_register else "host-page-tables"
            assert (tables.mode, tables.gpu_route) == ("shared", expected)
            gathers_match(tables)
        return
    with pytest.raises(DeviceError, match="cudaDevAttrHostRegisterReadOnlySupported is 0"):
        attach(checkpoint, socket=str(d.socket), share=True, device="cuda:0")
    with attach(checkpoint, socket=str(d.socket), device="cuda:0") as tables:
        assert (tables.mode, tables.gpu_route) == ("private", "private-registered")
        gathers_match(tables)


def test_the_opted_in_writable_mapping_is_registered_with_flags_0(
    checkpoint: Path, daemons: Any
) -> None:
    caps = _caps()
    if caps.read_only_register or caps.host_page_tables:
        pytest.skip("cuda:0 registers read-only memory: it never asks for a writable mapping")
    d = daemons("--checkpoint", str(checkpoint), "--allow-writable-gpu-mappings")
    with attach(checkpoint, socket=str(d.socket), share=True, device="cuda:0") as tables:
        assert (tables.mode, tables.gpu_route) == ("shared", "registered-writable")
        gathers_match(tables)


def test_a_cuda_host_import_gives_a_worker_read_only_access(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--backing", "cuda-host", "--checkpoint", str(checkpoint))
    [b] = d.status().backings
    if b.stands_in_for:
        pytest.skip(f"--backing cuda-host cannot be used here: {b.reason}")
    if "refuses read-only CPU access" in d.log:
        pytest.skip("the driver refuses read-only CPU access to host memory (see the log)")
    [s] = d.status().sets
    probe = JsonLinesChild([sys.executable, str(PROBE), str(d.socket), s.set_id, "attack"])
    probe.read()
    attack = probe.read()["attack"]
    # The driver's handle is no file to map; the import's CPU pages are not writable.
    assert attack["mmap_write"] != "mapped"
    assert "w" not in attack["perms"], attack
    # An importer may set its own access read-write on a real driver (docs/gpu.md, cuda-host).
    print("cuMemSetAccess read-write by an importer:", attack["set_access_read_write"])
    assert probe.proc.stdin is not None
    probe.proc.stdin.close()
    assert probe.proc.wait(timeout=60) == 0
