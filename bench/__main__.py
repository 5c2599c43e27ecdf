"""`make bench`: every performance claim of engramd, measured side by side in one run.

    python -m bench [--size-gib 2] [--load-gib 1] [--cold-gib 2] [--replicas 1,2,4,8]
                    [--attach-sizes 0.25,1,4] [--fleet-gib 1] [--swarm-gib 0.5] [--reps 5]
                    [--storm 64] [--proof-gib 1] [--live-gib 0.5]
                    [--cumem-gib 1,8,32] [--offload-gib 1.5]
                    [--only memory,attach,load,cold,...,gpu,cumem,fleet,swarm,offload,proof,live]

Prints a table (ours, baseline, ratio, spread of ours over repetitions,
target), writes bench/results/latest.json and, with matplotlib (the `bench`
extra), bench/results/memory.png. Synthetic checkpoints are cached in
--workdir between runs; every shm folder and mount it makes is removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from .attach import attach_and_restart
from .cold import cold_loads, reservation
from .common import Figure, as_json, checkpoint, machine, pyplot, save_plot
from .cumem import cumem_figures
from .descriptors import attach_by_kind, gather_by_kind, isolated_memory
from .fleet import fleet_fills
from .gather import gather_throughput
from .gpu import gpu_figures
from .hugepages import huge_page_figures
from .live import live_tables
from .load import load_throughput
from .memory import host_memory, page_tables
from .offload import offload_figures
from .proof import planning_costs, proof_costs
from .restart import restart_to_attach
from .storm import attach_storm
from .swarm import swarm_fills

SECTIONS = [
    "memory",
    "pagetables",
    "attach",
    "restart",
    "load",
    "cold",
    "gather",
    "storm",
    "fds",
    "hugepages",
    "gpu",
    "cumem",
    "fleet",
    "swarm",
    "offload",
    "proof",
    "live",
]
RESULTS = Path(__file__).resolve().parent / "results"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size-gib", type=float, default=2.0, help="tables for memory, load and gather (default 2)"
    )
    parser.add_argument(
        "--load-gib", type=float, default=1.0, help="checkpoint for the load section (default 1)"
    )
    parser.add_argument(
        "--cold-gib", type=float, default=2.0, help="checkpoint for the cold section (default 2)"
    )
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts for host memory")
    parser.add_argument("--attach-sizes", default="0.25,1,4", help="set sizes (GiB) for attach")
    parser.add_argument(
        "--huge-gib", type=float, default=8.0, help="tables for the page-size section (default 8)"
    )
    parser.add_argument(
        "--cumem-gib", default="1,8,32", help="set sizes (GiB) for the cuMem section"
    )
    parser.add_argument(
        "--fleet-gib", type=float, default=1.0, help="set for the fleet section (default 1)"
    )
    parser.add_argument(
        "--swarm-gib", type=float, default=0.5, help="set for the swarm section (default 0.5)"
    )
    parser.add_argument(
        "--offload-gib",
        type=float,
        default=1.5,
        help="PLE table for the disk_offload section (default 1.5)",
    )
    parser.add_argument(
        "--proof-gib", type=float, default=1.0, help="tensor for the proof section (default 1)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions per comparison")
    parser.add_argument(
        "--live-gib", type=float, default=0.5, help="tables for the live section (default 0.5)"
    )
    parser.add_argument("--storm", type=int, default=64, help="workers attaching at once")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections to run")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/engramd-bench"),
        help="cache of synthetic checkpoints",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    args = parser.parse_args()
    only = set(args.only.split(","))
    unknown = only - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.replicas.split(",")]

    started = time.time()
    host = machine()
    # Importing torch leaves ~10^6 objects; the interpreter's first full
    # collection of them (~70 ms) would land in whichever attach happens to
    # allocate next. It is the runtime's one-off cost, not engramd's.
    gc.collect()
    gc.freeze()
    print("machine:", ", ".join(f"{k}={v}" for k, v in host.items()), flush=True)
    figures: list[Figure] = []
    curves: dict[str, dict[int, float]] = {}
    main_ckpt = checkpoint(args.workdir, args.size_gib)
    if "memory" in only:
        print("host memory, shared versus private replicas")
        figures += host_memory(main_ckpt, counts, curves)
    if "pagetables" in only:
        print("page tables, 4 KiB versus 2 MiB tmpfs pages")
        figures += page_tables(main_ckpt, max(counts), args.size_gib)
    if "attach" in only:
        print("attach and restart, by set size")
        sizes = {gib: checkpoint(args.workdir, gib) for gib in _floats(args.attach_sizes)}
        figures += attach_and_restart(sizes)
    if "restart" in only:
        print("daemon restart until a worker attaches, 1 GiB set adopted from tmpfs")
        figures += restart_to_attach(checkpoint(args.workdir, 1.0), args.reps)
    if "load" in only:
        print("load throughput: engramd, cp and the anchor loaders, warm and cold")
        figures += load_throughput(checkpoint(args.workdir, args.load_gib), args.reps)
    if "cold" in only:
        print("cold load against the device: fio direct, a buffered read, engramd's load")
        figures += cold_loads(checkpoint(args.workdir, args.cold_gib), max(5, args.reps))
        figures += reservation(args.cold_gib, args.reps)
    if "gather" in only:
        print("gather throughput and the first gather after attach")
        figures += gather_throughput(main_ckpt, args.reps)
    if "storm" in only:
        print(f"{args.storm} workers attaching at once")
        figures += attach_storm(checkpoint(args.workdir, 0.25), args.storm, args.reps)

    if "fds" in only:
        print("handles by descriptor against handles by path; isolated workers")
        sizes = {gib: checkpoint(args.workdir, gib) for gib in _floats(args.attach_sizes)}
        figures += attach_by_kind(sizes)
        figures += gather_by_kind(main_ckpt, args.reps)
        figures += isolated_memory(main_ckpt, max(counts))

    if "hugepages" in only:
        print(f"page sizes at {args.huge_gib:g} GiB: tmpfs 4 KiB / 2 MiB, hugetlb 2 MiB / 1 GiB")
        figures += huge_page_figures(args.workdir, args.huge_gib, args.reps)

    if "gpu" in only:
        print("GPU: registration in place against pinned private copies; UVA gathers")
        figures += gpu_figures(main_ckpt, args.reps)
    if "cumem" in only:
        print("GPU: cuMem import of the daemon's pinned allocation against cudaHostRegister")
        figures += cumem_figures(args.workdir, _floats(args.cumem_gib), args.reps)

    if "fleet" in only:
        print("fills from a peer over a veth, from an object store, from cold files")
        figures += fleet_fills(checkpoint(args.workdir, args.fleet_gib), max(3, args.reps // 2))

    if "swarm" in only:
        print("a cold fleet of 5 filling at once from 1 warm node and each other, 200 Mbit/s links")
        figures += swarm_fills(checkpoint(args.workdir, args.swarm_gib), max(2, args.reps // 2))

    if "offload" in only:
        print("disk_offload: a PLE table's rows read each step from the daemon's disk copy")
        figures += offload_figures(args.workdir, args.offload_gib, args.reps)
    if "proof" in only:
        print("the proof of a held set (BLAKE3 against XXH3), and a store's headers planned")
        figures += proof_costs(args.proof_gib, args.reps)
        figures += planning_costs(400_000)
    if "live" in only:
        print("live tables: the step boundary, a fallen-back worker's move to the daemon's copy")
        figures += live_tables(checkpoint(args.workdir, args.live_gib), max(3, args.reps // 2))

    _print(figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": host,
        "config": {k: str(v) for k, v in vars(args).items()},
        "seconds": round(time.time() - started, 1),
        "memory_curves_gib": curves,
        "figures": as_json(figures),
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    if curves:
        _plot(curves, args.out.with_name("memory.png"))
    return 0


def _print(figures: list[Figure]) -> None:
    header = ["figure", "engramd", "baseline", "ratio", "spread (ours)", "target"]
    rows = [header] + [f.row() for f in figures]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print()
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    for f in figures:
        if f.note:
            print(f"  {f.name}: {f.note}")


def _plot(curves: dict[str, dict[int, float]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ns = sorted(curve)
        ax.plot(ns, [curve[n] for n in ns], marker="o", label=label)
    ax.set_xlabel("replicas on the node")
    ax.set_ylabel("host memory (GiB): Shmem + every replica's USS")
    ax.set_title("engramd: one shared copy versus private tables")
    ax.set_xticks(sorted(next(iter(curves.values()))))
    save_plot(fig, ax, path)


if __name__ == "__main__":
    sys.exit(main())
