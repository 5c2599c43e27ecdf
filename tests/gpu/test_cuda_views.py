"""CUDA views on a real GPU: registration in place, gathers equal to the CPU's, release.

Skipped with a reason where this process sees no CUDA device; `make
test-gpu` runs them (also with an interpreter that already has CUDA torch:
`make test-gpu PY=python3`).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from every_dtype import write_checkpoint

from engramd_client import attach, plan_tables

#: What every GPU test module is marked with: `gpu`, and skipped with a reason without CUDA.
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process"),
    pytest.mark.skipif(
        importlib.util.find_spec("cuda") is None,
        reason="NVIDIA's cuda-bindings is not installed (pip install cuda-bindings)",
    ),
]
pytestmark = GPU_ONLY


def _read_only_registration() -> str | None:
    """Why device 0 cannot register a read-only mapping, or None where it can."""
    if not torch.cuda.is_available():
        return None
    from engramd_client.cuda import device_caps

    caps = device_caps(0)
    if caps.read_only_register or caps.host_page_tables:
        return None
    return (
        "cuda:0 answers cudaDevAttrHostRegisterReadOnlySupported=0 and does not read host "
        "memory through its page tables: a shared tmpfs set reaches it only by the cuMem, "
        "opted-in writable or private routes (test_routes.py)"
    )


#: Tests of a shared tmpfs set registered in place: skipped with the device's reason.
needs_read_only_route = pytest.mark.skipif(
    _read_only_registration() is not None, reason=str(_read_only_registration())
)

WORKER = Path(__file__).parent / "gpu_worker.py"


def gathers_match(tables: Any, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in tables:
        cpu = tables[name]
        view = tables.cuda(name)
        assert view.device == torch.device("cuda", 0) and view.shape == cpu.shape, name
        assert view.dtype == cpu.dtype, name
        if cpu.numel() == 0:
            continue
        index = torch.randint(0, cpu.shape[0], (1024,), generator=g)
        if cpu.dtype in (torch.bfloat16, torch.float32, torch.float16):
            # The dtype's own gather kernel, as model code runs it.
            assert torch.equal(view.index_select(0, index.cuda()).cpu(), cpu.index_select(0, index))
        on_gpu = view.view(torch.uint8).index_select(0, index.cuda()).cpu()
        assert torch.equal(on_gpu, cpu.view(torch.uint8).index_select(0, index)), name


@needs_read_only_route
def test_a_shared_set_registered_in_several_workers_at_once(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    runs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(checkpoint), "--socket", str(d.socket)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    reports = []
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0
        reports.append(json.loads(out))
    expected = {"mode": "shared", "cpu": True, "ok": True, "rows": reports[0]["rows"]}
    assert all(r == expected for r in reports)
    [s] = d.status().sets
    assert s.lease_count == 0, "every worker unregistered and ended its lease"


@needs_read_only_route
def test_gpu_gathers_equal_cpu_gathers_for_every_dtype(tmp_path: Path, daemons: Any) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", sharded=True)
    d = daemons("--allow-root", str(tmp_path))
    with attach(ckpt, socket=str(d.socket), share=True, device="cuda:0") as tables:
        assert tables.mode == "shared" and tables.device == torch.device("cuda", 0)
        dtypes = {tables[n].dtype for n in tables}
        assert {torch.float8_e4m3fn, torch.bfloat16, torch.float32} <= dtypes
        for name in tables:
            # The view is the host pages themselves, not a copy in device memory.
            assert tables.cuda(name).numel() == 0 or not in_device_memory(tables.cuda(name))
        gathers_match(tables)
    assert d.status().sets[0].lease_count == 0


def in_device_memory(view: torch.Tensor) -> bool:
    """True when the view's pointer is device memory (cudaPointerGetAttributes)."""
    from cuda.bindings import runtime as rt

    err, attributes = rt.cudaPointerGetAttributes(view.data_ptr())
    assert int(err) == 0
    return bool(attributes.type == rt.cudaMemoryType.cudaMemoryTypeDevice)


@needs_read_only_route
def test_row_ranges_private_tables_and_reattach(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    name = "layers.1.engram.embed.weight"
    rows = {name: (1000, 3000)}
    with attach(checkpoint, socket=str(d.socket), rows=rows, device="cuda:0") as shard:
        assert shard.cuda(name).shape[0] == 2000
        gathers_match(shard)
    with attach(checkpoint, share=False, device="cuda:0") as private:
        assert private.mode == "private"
        gathers_match(private, seed=1)
    # Closing unregistered every page: the same tables register again.
    for seed in range(2):
        with attach(checkpoint, socket=str(d.socket), device="cuda:0") as again:
            gathers_match(again, seed)


@needs_read_only_route
def test_gathers_continue_through_a_daemon_restart(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(checkpoint), "--socket", str(d.socket), "--rounds", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    assert json.loads(worker.stdout.readline())["ok"]
    d.stop(signal.SIGKILL)
    worker.stdin.write("\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline())["ok"], "the mapping outlives the daemon"
    d.start()
    worker.stdin.write("\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline())["ok"]
    worker.stdin.close()
    assert worker.wait(timeout=60) == 0
    assert plan_tables(checkpoint).set_id == d.status().sets[0].set_id


@needs_read_only_route
def test_bind_puts_the_cuda_views_in_a_gpu_model(checkpoint: Path, daemons: Any) -> None:
    from torch import nn

    from engramd_client import bind

    d = daemons("--checkpoint", str(checkpoint))
    name = "layers.1.engram.embed.weight"
    with attach(checkpoint, socket=str(d.socket), device="cuda:0") as tables:
        module = nn.Module()
        module.register_buffer("weight", torch.empty_like(tables.cuda(name), device="meta"))
        bind(module, tables, {"weight": name}, cuda=True)
        assert module.get_buffer("weight").data_ptr() == tables.cuda(name).data_ptr()
    assert module.get_buffer("weight").is_meta
