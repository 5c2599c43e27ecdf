"""Host memory and page-table memory of N replicas, shared versus private."""

from __future__ import annotations

from pathlib import Path

from engramd_client import plan_tables

from .common import Figure, GiB, MiB, any_shm, compare, daemon, meminfo, shm_folder
from .replicas import replicas, touch_all

#: Per-replica cost of attaching beyond the runtime itself ("a fixed few MiB").
FEW_MIB = 8 * MiB


def host_memory(ckpt: Path, counts: list[int], curves: dict[str, dict[int, float]]) -> list[Figure]:
    """Node Shmem plus every replica's USS, for N shared and N private replicas."""
    table = plan_tables(ckpt).nbytes
    with replicas(ckpt, "", "none", 1) as [bare]:
        runtime = bare.uss()
    print(f"  runtime of a bare replica (python + torch): {runtime / MiB:.0f} MiB USS", flush=True)
    private: dict[int, float] = {}
    for n in counts:
        with replicas(ckpt, "", "private", n) as group:
            touch_all(group)
            private[n] = sum(r.uss() for r in group)
        print(f"  {n} private replicas: {private[n] / GiB:.2f} GiB", flush=True)
    shared: dict[int, float] = {}
    per_replica: dict[int, float] = {}
    before = meminfo()["Shmem"]
    with shm_folder() as shm, daemon(shm, "--checkpoint", str(ckpt)) as d:
        for n in counts:
            with replicas(ckpt, str(d.socket), "shared", n) as group:
                touch_all(group)
                shmem = meminfo()["Shmem"] - before
                uss = [r.uss() for r in group]
            shared[n] = shmem + sum(uss)
            per_replica[n] = (sum(uss) - n * runtime) / n
            print(
                f"  {n} shared replicas: {shared[n] / GiB:.2f} GiB "
                f"(shm {shmem / GiB:.3f} GiB, {per_replica[n] / MiB:.1f} MiB each beyond "
                "the runtime)",
                flush=True,
            )
    curves["private"] = {n: v / GiB for n, v in private.items()}
    curves["shared"] = {n: v / GiB for n, v in shared.items()}
    figures = []
    for n in counts:
        beyond = shared[n] - n * runtime
        figures.append(
            compare(
                f"host memory, {n} replicas",
                "GiB",
                [shared[n] / GiB],
                [private[n] / GiB],
                higher_is_better=False,
                target="shared <= 1.01x tables + few MiB/replica",
                met=beyond <= 1.01 * table + n * FEW_MIB,
                note=f"beyond the runtime: {beyond / table:.4f}x the table bytes, "
                f"{per_replica[n] / MiB:.1f} MiB per replica",
            )
        )
    return figures


def page_tables(ckpt: Path, n: int, size_gib: float) -> list[Figure]:
    """PageTables growth when N replicas touch every page: 4 KiB versus 2 MiB tmpfs pages."""
    gib = plan_tables(ckpt).nbytes / GiB
    per_process: dict[bool, float] = {}
    pmd_share = 0.0
    for huge in (False, True):
        with any_shm(huge, size_gib) as shm:
            if shm is None:
                print("  huge-page tmpfs: cannot mount here (needs root); not measured")
                continue
            with (
                daemon(shm, "--checkpoint", str(ckpt), *_pages_flag(huge)) as d,
                replicas(ckpt, str(d.socket), "shared", n) as group,
            ):
                before = meminfo()["PageTables"]
                touch_all(group)
                per_process[huge] = (meminfo()["PageTables"] - before) / n
                if huge:
                    # Counts each huge page once, however many processes map it.
                    pmd_share = meminfo()["ShmemPmdMapped"] / (gib * GiB)
            print(
                f"  {'2 MiB' if huge else '4 KiB'} pages: page tables grew "
                f"{per_process[huge] / 1024:.0f} KiB per process for {gib:.2f} GiB mapped",
                flush=True,
            )
    small = per_process[False] / 1024 / gib
    figures = [
        compare(
            "page tables per process, 4 KiB pages",
            "KiB/GiB",
            [small],
            None,
            higher_is_better=False,
            target="reported (~2048 KiB/GiB)",
            note=f"at 190 GiB: {small * 190 / 1024:.0f} MiB per worker process",
        )
    ]
    if True in per_process:
        figures.append(
            compare(
                "page tables per process, 2 MiB pages",
                "KiB/GiB",
                [per_process[True] / 1024 / gib],
                [small],
                higher_is_better=False,
                target="reported (< 1 MiB at 190 GiB)",
                note=f"{pmd_share:.0%} of the set PMD-mapped; a fully PMD-mapped GiB needs "
                "one 4 KiB page-table page (760 KiB at 190 GiB); file tails shorter than "
                "2 MiB stay on 4 KiB pages",
            )
        )
    return figures


def _pages_flag(huge: bool) -> list[str]:
    """The 4 KiB side keeps the daemon off its own huge-page tmpfs."""
    return [] if huge else ["--no-huge-tmpfs"]
