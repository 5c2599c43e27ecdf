"""Live tables on a real GPU: a worker started without its daemon reads engramd's private copy
through its registered CUDA views; at advance() it moves to the daemon's copy, the pages
registered again at the same addresses: the same device pointers, and a CUDA graph captured
before the move gathers the daemon's rows after it.

Skipped with a reason where this process sees no CUDA device (tools/gpu_check.sh runs
tests/gpu on a machine that has one).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from test_cuda_views import GPU_ONLY, needs_read_only_route

from engramd_client import attach

pytestmark = [*GPU_ONLY, needs_read_only_route]


def _captured_gather(
    view: torch.Tensor,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A CUDA graph of a gather of 4096 random rows of `view`, captured and replayed once:
    (the graph, its ids, its output)."""
    ids = torch.randint(0, view.shape[0], (4096,), device="cuda:0")
    out = torch.empty((4096, view.shape[1]), dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        torch.index_select(view, 0, ids, out=out)
    graph.replay()
    torch.cuda.synchronize()
    return graph, ids, out


def test_a_fallen_back_worker_moves_under_its_cuda_views_and_graphs(
    checkpoint: Path, sock_dir: Path, daemons: Any
) -> None:
    tables = attach(checkpoint, socket=str(sock_dir / "d.sock"), device="cuda:0")
    try:
        assert (tables.mode, tables.live, tables.gpu_route) == (
            "private",
            True,
            "private-registered",
        )
        name = next(n for n in tables if n.endswith(".weight"))
        view = tables.cuda(name).view(torch.uint8)
        pointer = view.data_ptr()
        graph, ids, out = _captured_gather(view)
        expected = tables[name].view(torch.uint8).index_select(0, ids.cpu())
        assert torch.equal(out.cpu(), expected)
        d = daemons("--checkpoint", str(checkpoint))
        ready = time.monotonic()
        while tables.mode != "shared" and time.monotonic() - ready < 2.0:
            tables.advance()
            time.sleep(0.002)
        assert tables.mode == "shared"
        assert tables.gpu_route in ("registered-read-only", "host-page-tables")
        assert tables.cuda(name).data_ptr() == pointer
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected)
        (leased,) = d.status().sets
        assert len(leased.leases) == 1
    finally:
        tables.close()


def test_a_new_generation_moves_under_cuda_views_and_graphs(
    checkpoint: Path, tmp_path: Path, daemons: Any
) -> None:
    """Tables attached shared are live: the operator's next generation replaces their pages
    at advance(), registered again at the same addresses; a CUDA graph captured on the first
    generation gathers the second's rows."""
    from engramd.testing.synth import SynthSpec, synthesize
    from helpers import load_set

    revised = tmp_path / "revised"
    shutil.copytree(checkpoint, revised)
    d = daemons("--checkpoint", str(revised))
    tables = attach(revised, socket=str(d.socket), share=True, device="cuda:0")
    try:
        assert (tables.mode, tables.live) == ("shared", True)
        name = next(n for n in tables if n.endswith(".weight"))
        view = tables.cuda(name).view(torch.uint8)
        pointer = view.data_ptr()
        graph, ids, out = _captured_gather(view)
        before = out.cpu()
        rows = tables[name].shape[0]
        synthesize(revised, SynthSpec(rows=rows, seed=1))
        ready = load_set(d, revised)
        began = time.monotonic()
        while tables.set_id != ready.set_id and time.monotonic() - began < 30:
            tables.advance()
            time.sleep(0.002)
        assert tables.set_id == ready.set_id
        assert tables.cuda(name).data_ptr() == pointer
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        expected = tables[name].view(torch.uint8).index_select(0, ids.cpu())
        assert torch.equal(out.cpu(), expected) and not torch.equal(expected, before)
    finally:
        tables.close()
