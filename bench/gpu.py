"""The GPU section: tables registered in place for UVA against exact-size pinned private copies.

Skipped, saying why, where this process sees no CUDA device.

- registration: seconds per GiB from attach(device=) to CUDA views, for the
  shared set (its pages registered in place) and for private tables (read
  into exact-size private memory, then registered the same way);
- UVA gathers, T=4096 rows per step: rows/s through the shared
  registration against private registered memory (goal >= 0.95x) and
  against the table copied into device memory (the ceiling);
- the first T=4096 step after an attach with a device.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from engramd_client import Tables, attach, plan_tables

from .attach import wait_locked
from .common import Figure, GiB, compare, daemon, shm_folder

TOKENS = 4096
STEPS = 200
DEVICE = "cuda:0"


def gpu_figures(ckpt: Path, reps: int) -> list[Figure]:
    """Every GPU figure, or none (with the reason printed) without a CUDA device."""
    if not torch.cuda.is_available():
        print("  skipped: this process sees no CUDA device", flush=True)
        return []
    gib = plan_tables(ckpt).nbytes / GiB
    with shm_folder() as folder, daemon(folder, "--checkpoint", str(ckpt)) as d:
        wait_locked(d)
        socket = str(d.socket)
        shared_s, first_ms = [], []
        for _ in range(reps):
            start = time.perf_counter()
            tables = attach(ckpt, socket=socket, share=True, device=DEVICE)
            shared_s.append(time.perf_counter() - start)
            _step(cuda_views(tables), 0)
            first_ms.append((time.perf_counter() - start) * 1e3)
            tables.close()
        private_s = attach_seconds(ckpt, reps, share=False)
        figures = [
            compare(
                f"register for UVA, {gib:.1f} GiB",
                "s/GiB",
                [s / gib for s in shared_s],
                [s / gib for s in private_s],
                higher_is_better=False,
                target="reported (shared in place vs private exact-size pinned)",
            ),
            compare(
                f"attach with a device and first T={TOKENS} step, {gib:.1f} GiB",
                "ms",
                first_ms,
                None,
                higher_is_better=False,
                target="reported",
            ),
        ]
        shared = attach(ckpt, socket=socket, share=True, device=DEVICE)
        private = attach(ckpt, share=False, device=DEVICE)
        in_hbm = {name: shared[name].to(DEVICE) for name in shared}
        rates: dict[str, list[float]] = {"shared": [], "private": [], "device": []}
        for rep in range(reps):
            for side, views in (
                ("shared", cuda_views(shared)),
                ("private", cuda_views(private)),
                ("device", {n: t.view(torch.uint8) for n, t in in_hbm.items()}),
            ):
                rates[side].append(gather_rate(views, rep))
        shared.close()
        private.close()
    figures.append(
        compare(
            f"UVA gather T={TOKENS}, shared registration vs private pinned, {gib:.1f} GiB",
            "Mrows/s",
            rates["shared"],
            rates["private"],
            higher_is_better=True,
            target=">= 0.95x private pinned",
            at_least=0.95,
        )
    )
    figures.append(
        compare(
            f"UVA gather T={TOKENS}, shared registration vs the table in device memory",
            "Mrows/s",
            rates["shared"],
            rates["device"],
            higher_is_better=True,
            target="reported (device memory is the ceiling)",
        )
    )
    return figures


def attach_seconds(ckpt: Path, reps: int, **how: Any) -> list[float]:
    """Seconds from attach(ckpt, device=DEVICE, **how) to CUDA views, `reps` times.

    The close is not counted: both sides of a comparison are timed alike.
    """
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        tables = attach(ckpt, device=DEVICE, **how)
        seconds.append(time.perf_counter() - start)
        tables.close()
    return seconds


def cuda_views(tables: Tables) -> dict[str, torch.Tensor]:
    """Each table's CUDA view as bytes [rows, row bytes]: one gather kernel for every dtype."""
    return {name: tables.cuda(name).view(torch.uint8) for name in tables if tables[name].numel()}


def _step(views: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for table in views.values():
        index = torch.randint(0, table.shape[0], (TOKENS,), generator=g, device=DEVICE)
        table.index_select(0, index)
    torch.cuda.synchronize()


def gather_rate(views: dict[str, torch.Tensor], seed: int) -> float:
    """Million rows per second over STEPS steps of T rows from every table."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    indices = {
        name: torch.randint(0, t.shape[0], (STEPS, TOKENS), generator=g, device=DEVICE)
        for name, t in views.items()
    }
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(STEPS):
        for name, table in views.items():
            table.index_select(0, indices[name][step])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return STEPS * TOKENS * len(views) / seconds / 1e6
