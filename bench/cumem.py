"""The CUDA-handle section: tables GPU-readable by cuMem import, against registering a shm mapping.

Skipped, saying why, where this process sees no CUDA device or the daemon's
cuda-host backing cannot work (its stand-in's reason is printed).

- time from attach(device=) to CUDA views, at each size: a cuda-host daemon
  (the worker imports the daemon's already pinned allocation) against a
  tmpfs daemon (the worker registers its shm mapping with cudaHostRegister);
  goal: >= 100x faster at 8 GiB, and about constant in size;
- UVA gathers, T=4096 rows per step, at the largest size: rows/s through
  cuMem host memory against the registered shm mapping and against the
  table copied into device memory (the ceiling).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engramd_client import attach

from .attach import wait_locked
from .common import Figure, checkpoint, compare, daemon, shm_folder
from .gpu import DEVICE, TOKENS, attach_seconds, cuda_views, gather_rate

#: The size at which the import must beat registration by IMPORT_GOAL.
GOAL_GIB = 8
IMPORT_GOAL = 100


def cumem_figures(workdir: Path, sizes: list[float], reps: int) -> list[Figure]:
    """Import against registration at each size; gathers at the largest; none without CUDA."""
    if not torch.cuda.is_available():
        print("  skipped: this process sees no CUDA device", flush=True)
        return []
    figures: list[Figure] = []
    rates: dict[str, list[float]] = {}
    largest = max(sizes)
    for gib in sorted(sizes):
        ckpt = checkpoint(workdir, gib)
        with (
            shm_folder() as folder,
            daemon(folder, "--backing", "cuda-host", "--checkpoint", str(ckpt)) as d,
        ):
            backing = d.status().backings[0]
            if backing.stands_in_for:
                print(f"  skipped: cuda-host cannot be used here: {backing.reason}", flush=True)
                return figures
            socket = str(d.socket)
            imported = attach_seconds(ckpt, reps, socket=socket, share=True)
            if gib == largest:
                with attach(ckpt, socket=socket, share=True, device=DEVICE) as tables:
                    rates["cumem"] = [gather_rate(cuda_views(tables), rep) for rep in range(reps)]
        with shm_folder() as folder, daemon(folder, "--checkpoint", str(ckpt)) as d:
            wait_locked(d)
            socket = str(d.socket)
            registered = attach_seconds(ckpt, reps, socket=socket, share=True)
            if gib == largest:
                with attach(ckpt, socket=socket, share=True, device=DEVICE) as tables:
                    rates["registered"] = [
                        gather_rate(cuda_views(tables), rep) for rep in range(reps)
                    ]
                    in_hbm = {n: tables[n].to(DEVICE).view(torch.uint8) for n in cuda_views(tables)}
                rates["device"] = [gather_rate(in_hbm, rep) for rep in range(reps)]
                del in_hbm
        goal = gib == GOAL_GIB
        figures.append(
            compare(
                f"attach to GPU-readable tables, {gib:g} GiB: cuMem import vs cudaHostRegister",
                "s",
                imported,
                registered,
                higher_is_better=False,
                target=f">= {IMPORT_GOAL}x faster" if goal else "reported",
                at_least=IMPORT_GOAL if goal else None,
            )
        )
    for baseline, target in (
        ("registered", "reported (cuMem host memory vs the registered shm mapping)"),
        ("device", "reported (device memory is the ceiling)"),
    ):
        figures.append(
            compare(
                f"UVA gather T={TOKENS}, cuMem host memory vs {baseline}, {largest:g} GiB",
                "Mrows/s",
                rates["cumem"],
                rates[baseline],
                higher_is_better=True,
                target=target,
            )
        )
    return figures
