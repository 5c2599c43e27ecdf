"""Load throughput: engramd's loader against `cp` and the loaders an operator would pick instead.

Each way reads the same safetensors checkpoint into memory, alternating:
engramd's loader into its default backing (the daemon's huge-page tmpfs
where it may mount one, with the manifest's XXH3 of every tensor), the same
into /dev/shm's own 4 KiB pages (--no-huge-tmpfs), `cp` of the files into a
/dev/shm folder, Run:ai Model Streamer (CPU, its default concurrency),
fastsafetensors (CPU mode: pread into a host buffer, no GDS) and
safetensors' `load_file`, whose tensors map the file's page cache: its
figure includes a `clone` of each, the private copy the others make. Warm
(page cache hot) and cold (`echo 3 > /proc/sys/vm/drop_caches` before each
read; root only).

On the development VM the first touch of memory the guest has not used for
a while is slow (the hypervisor backs it again): measured 0.29-0.97 GB/s
into huge pages there, against 4.2-4.9 GB/s into pages a huge-page tmpfs
held a moment before (and anonymous THP freed before did not help). So
every way starts on memory just written and freed through a huge-page tmpfs
(`recycle`, untimed), and none inherits the one before it's; one row, the
default without that step, shows what a daemon meets on such a VM.

The anchor loaders come from bench/requirements-anchors.txt
(`make bench` installs it); a missing one is reported, not measured.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engramd.backings import TmpfsBacking
from engramd.config import DaemonConfig
from engramd.sets.loader import LoadProgress, load_set
from engramd_client import plan_tables
from engramd_shared.checkpoint import TablePlan

from .common import Figure, GiB, compare, drop_caches, huge_tmpfs, shm_folder, timed

#: What `engramd serve` does by default: the default backing, its default load threads.
DEFAULT = "engramd, default backing, default threads"
#: The default on memory as the way before left it (the module's docstring).
FRESH = "engramd, default backing, default threads, memory not recycled"
#: The daemon's default --load-threads (0: the reads sized to the checkpoint's device).
THREADS = DaemonConfig().load_threads
#: Where the anchors come from.
ANCHORS = "bench/requirements-anchors.txt"

#: Reads the plan's checkpoint into memory (a scratch shm folder); returns the seconds it took.
Way = Callable[[TablePlan, Path], float]


def _engramd(huge: bool, threads: int) -> Way:
    def run(plan: TablePlan, shm: Path) -> float:
        backing = TmpfsBacking(str(shm), None, huge_tmpfs=huge)
        backing.claim()  # mounts the huge-page tmpfs: untimed, the daemon does it once
        try:
            return timed(lambda: load_set(plan, backing, threads, LoadProgress(plan.nbytes)))
        finally:
            # Its lock on the shm folder would keep the detached mount, and its set, alive.
            backing.release()

    return run


def _files(plan: TablePlan) -> list[str]:
    return sorted({str(t.file) for t in plan.tensors})


def _cp(plan: TablePlan, shm: Path) -> float:
    return timed(lambda: subprocess.run(["cp", *_files(plan), str(shm)], check=True))


def _holding(read: Callable[[list[str], list[Any]], None]) -> Way:
    """A way that reads tensors into a list held until the clock stops (freeing is not timed)."""

    def run(plan: TablePlan, shm: Path) -> float:
        held: list[Any] = []
        return timed(lambda: read(_files(plan), held))

    return run


def _runai(files: list[str], held: list[Any]) -> None:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        held.extend(t for _, t in streamer.get_tensors())


def _fastsafetensors(files: list[str], held: list[Any]) -> None:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(files, nogds=True, device="cpu") as f:
        names = f.keys()
        held.extend(f.get_tensor(k) for k in names)


def _load_file(files: list[str], held: list[Any]) -> None:
    from safetensors.torch import load_file

    held.extend(t.clone() for f in files for t in load_file(f).values())


def _missing(module: str) -> str:
    try:
        __import__(module)
    except ImportError as e:
        return f"not measured: {e} (pip install -r {ANCHORS}, as `make bench` does)"
    return ""


def _warm(ckpt: Path) -> None:
    for f in ckpt.iterdir():
        with open(f, "rb") as src:
            while src.read(64 << 20):
                pass


def recycle(nbytes: int) -> None:
    """Write and free `nbytes` (and a margin) through a huge-page tmpfs (a /dev/shm folder
    where mounting is not permitted), so the next way gets memory the VM backs now."""
    size = nbytes + nbytes // 8
    with huge_tmpfs(size / GiB) as mounted, shm_folder() as folder:
        fd = os.open((mounted or folder) / "recycle", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            zeros = bytes(64 << 20)
            for at in range(0, size, len(zeros)):
                os.pwrite(fd, zeros[: size - at], at)
        finally:
            os.close(fd)


def load_throughput(ckpt: Path, reps: int) -> list[Figure]:
    """GB/s of each way reading the checkpoint into memory, alternating them; warm and cold."""
    plan = plan_tables(ckpt)
    file_bytes = sum(os.path.getsize(f) for f in _files(plan))
    huge = DaemonConfig().huge_tmpfs
    ways: dict[str, tuple[Way, int]] = {
        "cp": (_cp, file_bytes),
        DEFAULT: (_engramd(huge, THREADS), plan.nbytes),
        FRESH: (_engramd(huge, THREADS), plan.nbytes),
        "engramd, default backing, 1 thread": (_engramd(huge, 1), plan.nbytes),
        "engramd, /dev/shm 4 KiB pages, default threads": (_engramd(False, THREADS), plan.nbytes),
        "runai-model-streamer (CPU)": (_holding(_runai), file_bytes),
        "fastsafetensors (CPU, nogds)": (_holding(_fastsafetensors), file_bytes),
        "safetensors load_file + clone": (_holding(_load_file), file_bytes),
    }
    notes = {
        "runai-model-streamer (CPU)": _missing("runai_model_streamer"),
        "fastsafetensors (CPU, nogds)": _missing("fastsafetensors"),
        "safetensors load_file + clone": _missing("safetensors.torch"),
    }
    for name, note in notes.items():
        if note:
            print(f"  {name}: {note}", flush=True)
            del ways[name]
    caches = ["warm"]
    if os.geteuid() == 0:
        caches.append("cold")
    else:
        print("  cold: not measured (dropping the page cache needs root)", flush=True)
    figures = []
    for cache in caches:
        rates: dict[str, list[float]] = {name: [] for name in ways}
        # Cold reads take the longest, so fewer of them; but never one alone: this
        # VM's disk swings up to 2x between minutes, so each ratio is the median
        # of the ratios of one turn (the ways of a turn read within seconds).
        for _ in range(reps if cache == "warm" else max(3, reps // 2)):
            for name, (way, nbytes) in ways.items():
                if name != FRESH:
                    recycle(nbytes)
                if cache == "cold":
                    drop_caches()
                else:
                    _warm(ckpt)
                rates[name].append(nbytes / _scratch(way, plan) / 1e9)
        anchors = [s for n, s in rates.items() if not n.startswith(("cp", "engramd"))]
        best_anchor = max((sorted(s)[len(s) // 2] for s in anchors), default=0.0)
        for name, samples in rates.items():
            print(f"  {cache} {name}: {sorted(samples)[len(samples) // 2]:.2f} GB/s", flush=True)
            if name == "cp":
                continue
            goal = name == DEFAULT
            figures.append(
                compare(
                    f"load {cache}: {name}",
                    "GB/s",
                    samples,
                    rates["cp"],
                    higher_is_better=True,
                    target=(">= 1.5x cp" if cache == "warm" else ">= 1.0x cp") if goal else "",
                    at_least=(1.5 if cache == "warm" else 1.0) if goal else None,
                    paired=True,
                    note=(
                        f"fastest anchor {best_anchor:.2f} GB/s"
                        if goal and best_anchor
                        else notes.get(name, "")
                    ),
                )
            )
    return figures


def _scratch(way: Way, plan: TablePlan) -> float:
    """Seconds `way` takes to read the plan into memory (a fresh shm folder, removed afterwards)."""
    with shm_folder() as shm:
        return way(plan, shm)
