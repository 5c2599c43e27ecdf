"""Handles by descriptor (the fd channel) against handles by path, and isolated workers' memory.

- attach p50/p99 through fds against paths, per set size (tmpfs), and
  through fds of a memfd set;
- gathers through an fd mapping, a path mapping and private tensors;
- host memory of N workers that each have their own mount and IPC namespace
  and a 64 MiB /dev/shm (Docker's default), attached to a memfd set.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path

import torch

from engramd_client import Tables, attach, plan_tables

from .attach import wait_locked
from .common import (
    Figure,
    GiB,
    MiB,
    accepting,
    compare,
    daemon,
    meminfo,
    percentile,
    shm_folder,
)
from .gather import Lookup
from .replicas import replicas, touch_all

ATTACHES = 20
#: A container of its own: private mount and IPC namespaces, Docker's /dev/shm.
ISOLATED = [
    "unshare",
    "--mount",
    "--ipc",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
    "sh",
]


def _attach_ms(ckpt: Path, socket: str, kinds: str) -> float:
    with accepting(kinds):
        start = time.perf_counter()
        tables = attach(ckpt, socket=socket, share=True)
        took = time.perf_counter() - start
    tables.close()
    return took * 1e3


def attach_by_kind(sizes: dict[float, Path]) -> list[Figure]:
    """Attach latency through fds against paths (interleaved), per size; fds of a memfd set."""
    figures = []
    for gib, ckpt in sizes.items():
        for backing in ("tmpfs", "memfd"):
            with (
                shm_folder() as shm,
                daemon(shm, "--checkpoint", str(ckpt), "--backing", backing) as d,
            ):
                wait_locked(d)
                socket = str(d.socket)
                _attach_ms(ckpt, socket, "fd")  # the process's first attach starts gRPC
                kinds = ["fd"] if backing == "memfd" else ["fd", "shm"]
                samples: dict[str, list[float]] = {k: [] for k in kinds}
                for _ in range(ATTACHES):
                    for kind in kinds:
                        samples[kind].append(_attach_ms(ckpt, socket, kind))
            by_path = samples.get("shm")
            p99 = percentile(samples["fd"], 99)
            print(
                f"  {gib:g} GiB {backing}: attach by fd p50 {statistics.median(samples['fd']):.2f}"
                f" ms p99 {p99:.2f} ms"
                + (
                    f"; by path p50 {statistics.median(by_path):.2f} ms p99 "
                    f"{percentile(by_path, 99):.2f} ms"
                    if by_path
                    else ""
                ),
                flush=True,
            )
            figures.append(
                compare(
                    f"attach p99 by fd, {backing}, {gib:g} GiB",
                    "ms",
                    [p99],
                    [percentile(by_path, 99)] if by_path else None,
                    higher_is_better=False,
                    target="< 10 ms, constant in size (baseline: by path)",
                    met=p99 < 10,
                    note=f"p50 {statistics.median(samples['fd']):.2f} ms",
                )
            )
    return figures


def gather_by_kind(ckpt: Path, reps: int) -> list[Figure]:
    """Rows/s through an fd mapping against a path mapping and private tensors (4 KiB pages)."""
    figures = []
    torch.set_num_threads(1)
    private = attach(ckpt, share=False)
    with shm_folder() as shm, daemon(shm, "--checkpoint", str(ckpt)) as d:
        sides: dict[str, Tables] = {"private": private}
        for kind in ("fd", "shm"):
            with accepting(kind):
                sides[kind] = attach(ckpt, socket=str(d.socket), share=True, populate=True)
        for tokens in (1, 4096):
            lookups = {name: Lookup(t, tokens) for name, t in sides.items()}
            for lookup in lookups.values():
                lookup.step()
            rates: dict[str, list[float]] = {name: [] for name in lookups}
            for rep in range(reps):
                order = list(lookups) if rep % 2 else list(reversed(lookups))
                for name in order:
                    rates[name].append(lookups[name].rate() / 1e6)
            for baseline in ("shm", "private"):
                figures.append(
                    compare(
                        f"gather T={tokens} by fd vs {'path' if baseline == 'shm' else baseline}",
                        "Mrows/s",
                        rates["fd"],
                        rates[baseline],
                        higher_is_better=True,
                        target=">= 0.95x",
                        at_least=0.95,
                    )
                )
                print(
                    f"  {figures[-1].name}: {figures[-1].ratio:.3f}x "
                    f"({figures[-1].ours:.1f} vs {figures[-1].baseline:.1f} Mrows/s)",
                    flush=True,
                )
        for tables in sides.values():
            tables.close()
    torch.set_num_threads(2)
    return figures


def isolated_memory(ckpt: Path, n: int) -> list[Figure]:
    """Host memory of N workers in namespaces of their own: one memfd set against N private."""
    if subprocess.run([*ISOLATED, "true"], capture_output=True).returncode != 0:
        print("  isolated workers: cannot create namespaces here (needs root); not measured")
        return []
    table = plan_tables(ckpt).nbytes
    with replicas(ckpt, "", "private", n, prefix=ISOLATED) as group:
        touch_all(group)
        private = sum(r.uss() for r in group)
    before = meminfo()["Shmem"]
    with (
        shm_folder() as shm,
        daemon(shm, "--checkpoint", str(ckpt), "--backing", "memfd") as d,
        replicas(ckpt, str(d.socket), "shared", n, prefix=ISOLATED) as group,
    ):
        modes = {r.attached["mode"] for r in group}
        touch_all(group)
        shmem = meminfo()["Shmem"] - before
        shared = shmem + sum(r.uss() for r in group)
    print(
        f"  {n} isolated workers: shared {shared / GiB:.2f} GiB (Shmem {shmem / GiB:.3f} GiB, "
        f"modes {sorted(modes)}), private {private / GiB:.2f} GiB",
        flush=True,
    )
    return [
        compare(
            f"host memory, {n} isolated workers (memfd)",
            "GiB",
            [shared / GiB],
            [private / GiB],
            higher_is_better=False,
            target="one copy: Shmem <= 1.01x tables",
            met=modes == {"shared"} and shmem <= 1.01 * table,
            note=f"each worker: own mount+IPC namespace, 64 MiB /dev/shm; Shmem "
            f"{shmem / MiB:.0f} MiB for {table / MiB:.0f} MiB of tables",
        )
    ]
