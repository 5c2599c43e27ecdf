"""cuMem handles on a real GPU: the cuda-host and cuda-device backings, imported by workers.

Skipped with a reason where this process sees no CUDA device; `make
test-gpu` runs them. The parts that need no GPU (the stand-in when CUDA
cannot work, handle kinds, device-only tables) are in tests/test_cuda_backings.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_views import GPU_ONLY, gathers_match, in_device_memory

from conftest import wait_until
from engramd_client import attach, plan_tables
from engramd_client.fdchannel import collect
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.errors import NoCpuView, NotAllowed
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import reference_digests

pytestmark = GPU_ONLY

WORKER = Path(__file__).parent / "gpu_worker.py"
NAME = "layers.1.engram.embed.weight"


def _cuda_daemon(daemons: Any, checkpoint: Path, backing: str) -> Any:
    """A daemon serving the checkpoint from `backing`; fails with its reason if it stood aside."""
    d = daemons("--backing", backing, "--checkpoint", str(checkpoint))
    status = d.status()
    [b] = status.backings
    if b.stands_in_for:
        # The device or driver said no (attributes, or the trial allocation in a child).
        pytest.skip(f"--backing {backing} cannot be used here: {b.reason}")
    assert b.name == backing.partition(":")[0], b.reason
    [s] = status.sets
    assert s.backing == b.name and s.state == "ready"
    return d


def _workers(d: Any, checkpoint: Path, count: int, rounds: int = 1) -> list[subprocess.Popen[str]]:
    command = [sys.executable, str(WORKER), str(checkpoint), "--socket", str(d.socket)]
    return [
        subprocess.Popen(
            [*command, "--rounds", str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]


def _round(worker: subprocess.Popen[str], go: bool = False) -> dict[str, Any]:
    assert worker.stdin is not None and worker.stdout is not None
    if go:
        worker.stdin.write("\n")
        worker.stdin.flush()
    line = worker.stdout.readline()
    assert line, f"the worker exited with {worker.wait(timeout=30)}"
    report: dict[str, Any] = json.loads(line)
    return report


def _finish(workers: list[subprocess.Popen[str]]) -> None:
    for w in workers:
        assert w.stdin is not None
        w.stdin.close()
        assert w.wait(timeout=120) == 0


def test_a_cuda_host_set_imported_by_several_workers_at_once(
    checkpoint: Path, daemons: Any
) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-host")
    workers = _workers(d, checkpoint, 3, rounds=2)
    reports = [_round(w) for w in workers]
    assert all(r["ok"] and r["cpu"] and r["mode"] == "shared" for r in reports), reports
    [s] = d.status().sets
    assert s.locked, "cuMem host memory is pinned from its allocation on"
    assert [lease.kind for lease in s.leases] == [pb.HANDLE_KIND_CUMEM] * 3
    assert {lease.device for lease in s.leases} == {"cuda:0"}
    assert all(_round(w, go=True)["ok"] for w in workers)
    _finish(workers)
    wait_until(lambda: d.status().sets[0].lease_count == 0, 10, "every lease ended")


def test_cpu_views_hold_the_checkpoint_and_the_cuda_views_are_the_same_memory(
    checkpoint: Path, daemons: Any
) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-host")
    with attach(checkpoint, socket=str(d.socket), share=True, device="cuda:0") as tables:
        assert tables.mode == "shared" and tables.device == torch.device("cuda", 0)
        digests = {
            n: hashlib.sha256(tables[n].contiguous().view(torch.uint8).numpy().data).hexdigest()
            for n in tables
        }
        assert digests == reference_digests(checkpoint)
        for name in tables:
            if tables[name].numel():
                # One mapping: the CPU and the GPU read the same (UVA) addresses.
                assert tables.cuda(name).data_ptr() == tables[name].data_ptr()
                assert not in_device_memory(tables.cuda(name))
        gathers_match(tables)
    rows = {NAME: (1000, 3000)}
    with attach(checkpoint, socket=str(d.socket), rows=rows, device="cuda:0") as shard:
        assert shard.cuda(NAME).shape[0] == 2000
        gathers_match(shard, seed=1)


def test_cumem_descriptors_go_only_to_the_lease_holder_and_once(
    checkpoint: Path, daemons: Any
) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-host")
    plan = plan_tables(checkpoint)
    request = pb.AttachRequest(
        set_id=plan.set_id, pid=os.getpid(), accept=[pb.HANDLE_KIND_CUMEM], device="cuda:0"
    )
    with open_channel(ClientConfig(socket=str(d.socket))) as channel:
        call = pb_grpc.TableServiceStub(channel).Attach(request)
        attachment = next(call).attached
        assert {h.WhichOneof("handle") for h in attachment.tensors} == {"cumem"}
        fd_socket = attachment.fd_channel.socket
        with pytest.raises(NotAllowed, match="no live lease"):
            collect(fd_socket, attachment.lease_id, "0" * 32, 2.0)
        fds = collect(fd_socket, attachment.lease_id, attachment.fd_channel.secret, 2.0)
        assert list(fds) == ["tables"]
        for fd in fds.values():
            os.close(fd)
        with pytest.raises(NotAllowed, match="collected already"):
            collect(fd_socket, attachment.lease_id, attachment.fd_channel.secret, 2.0)
        call.cancel()


def test_workers_keep_gathering_through_a_daemon_sigkill(checkpoint: Path, daemons: Any) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-host")
    [worker] = _workers(d, checkpoint, 1, rounds=3)
    assert _round(worker)["ok"]
    d.stop(signal.SIGKILL)
    assert _round(worker, go=True)["ok"], "the worker's import outlives the daemon"
    d.start()
    # The new daemon loads a new copy: the worker's lease comes back, marked stale.
    wait_until(lambda: any(lease.stale for lease in d.status().sets[0].leases), 30, "a stale lease")
    assert _round(worker, go=True)["ok"]
    _finish([worker])


def test_a_cuda_device_set_shared_by_two_processes(checkpoint: Path, daemons: Any) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-device:0")
    workers = _workers(d, checkpoint, 2)
    reports = [_round(w) for w in workers]
    assert all(r["ok"] and not r["cpu"] and r["mode"] == "shared" for r in reports), reports
    _finish(workers)
    with attach(checkpoint, socket=str(d.socket), share=True, device="cuda:0") as tables:
        assert in_device_memory(tables.cuda(NAME))
        with pytest.raises(NoCpuView, match=r"tables\.cuda"):
            tables[NAME]
    [s] = d.status().sets
    assert s.backing == "cuda-device"


def test_a_worker_without_a_device_loads_privately_and_is_told_why(
    checkpoint: Path, daemons: Any
) -> None:
    d = _cuda_daemon(daemons, checkpoint, "cuda-host")
    with attach(checkpoint, socket=str(d.socket)) as tables:
        assert tables.mode == "private"
        assert tables.reason is not None and "device='cuda:N'" in tables.reason
