"""What every benchmark section shares: figures, statistics, the machine, checkpoints, daemons."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engramd.host.hugeroot import remove_shm_folder
from engramd.testing.daemon_process import DaemonProcess
from engramd.testing.pagecache import evict
from engramd.testing.synth import SCALE_GROUP, SynthSpec, synthesize

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Figure:
    """One measured comparison: engramd's side, the baseline's, their ratio."""

    name: str
    unit: str
    ours: float
    baseline: float | None = None
    #: ours / baseline, or baseline / ours when `higher_is_better` is False.
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    #: [min, max] of ours over the repetitions.
    spread: list[float] = field(default_factory=list)
    note: str = ""

    def row(self) -> list[str]:
        """Cells of the printed table."""
        return [
            self.name,
            f"{self.ours:,.3g} {self.unit}",
            "" if self.baseline is None else f"{self.baseline:,.3g} {self.unit}",
            "" if self.ratio is None else f"{self.ratio:.2f}x",
            "" if not self.spread else f"{self.spread[0]:,.3g}..{self.spread[1]:,.3g}",
            self.target + ("" if self.met is None else ("  met" if self.met else "  MISSED")),
        ]


def compare(
    name: str,
    unit: str,
    ours: list[float],
    baseline: list[float] | None,
    *,
    higher_is_better: bool,
    target: str = "",
    at_least: float | None = None,
    at_most: float | None = None,
    met: bool | None = None,
    note: str = "",
    paired: bool = False,
) -> Figure:
    """A Figure from repeated samples: medians, spread of ours, ratio, and whether the target holds.

    `at_least` / `at_most` bound the ratio when there is a baseline, else the
    median of ours; `met` gives the verdict directly for targets of another shape.
    `paired`: ours[i] and baseline[i] were taken in the same turn of the sides,
    so the ratio is the median of the pairs' ratios, which a machine's slow
    moments (shared by both samples of a pair) do not move as they move a
    ratio of medians.
    """
    mine = statistics.median(ours)
    base = statistics.median(baseline) if baseline else None
    ratio = None
    if paired and baseline and min(ours + baseline) > 0:
        ratio = paired_ratio(ours, baseline) if higher_is_better else paired_ratio(baseline, ours)
    elif base is not None and min(base, mine) > 0:
        ratio = mine / base if higher_is_better else base / mine
    judged = ratio if ratio is not None else mine
    if at_least is not None:
        met = judged >= at_least
    if at_most is not None:
        met = judged <= at_most
    return Figure(
        name=name,
        unit=unit,
        ours=mine,
        baseline=base,
        ratio=ratio,
        target=target,
        met=met,
        spread=[min(ours), max(ours)] if len(ours) > 1 else [],
        note=note,
    )


def paired_ratio(ours: list[float], baseline: list[float]) -> float:
    """The median of ours[i] / baseline[i], each pair taken within one turn of the sides."""
    return statistics.median(o / b for o, b in zip(ours, baseline, strict=True))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` (all its threads) used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        parts = value.split()
        out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def machine() -> dict[str, Any]:
    """What this machine can and cannot show, next to the figures."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "unavailable"

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(meminfo()["MemTotal"] / GiB, 1),
        "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": "none" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "dev_shm_total_gib": round(shutil.disk_usage("/dev/shm").total / GiB, 1),
    }


def rows_for(gib: float) -> int:
    """Rows per table that make `gib` GiB of Engram tables (synth's default layout)."""
    spec = SynthSpec()
    per_row = spec.layers * (spec.dim + spec.dim // SCALE_GROUP)
    return max(1_000, round(gib * GiB / per_row))


def checkpoint(workdir: Path, gib: float) -> Path:
    """A synthetic checkpoint of about `gib` GiB of tables, cached in `workdir`."""
    rows = rows_for(gib)
    folder = workdir / f"ckpt-{rows}"
    done = folder / ".complete"
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"  synthesizing {gib:g} GiB of tables into {folder} ...", flush=True)
        synthesize(folder, SynthSpec(rows=rows))
        done.touch()
    return folder


@contextlib.contextmanager
def daemon(shm_dir: Path, *args: str, wait: str = "serving") -> Iterator[DaemonProcess]:
    """A daemon on a temporary socket over `shm_dir`; stopped (sets dropped) afterwards."""
    sock_dir = Path(tempfile.mkdtemp(prefix="eb", dir="/tmp"))
    d = DaemonProcess(sock_dir / "d.sock", shm_dir, ["--drop-on-exit", *args], sock_dir / "log")
    try:
        yield d.start(wait=wait)
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@contextlib.contextmanager
def accepting(kinds: str) -> Iterator[None]:
    """Attaches in this block, and workers started in it, accept only `kinds` (ENGRAMD_HANDLES)."""
    before = os.environ.get("ENGRAMD_HANDLES")
    os.environ["ENGRAMD_HANDLES"] = kinds
    try:
        yield
    finally:
        if before is None:
            del os.environ["ENGRAMD_HANDLES"]
        else:
            os.environ["ENGRAMD_HANDLES"] = before


@contextlib.contextmanager
def shm_folder() -> Iterator[Path]:
    """A fresh folder under /dev/shm; removed afterwards.

    A daemon with its default flags puts its sets there on 2 MiB pages where it
    may (a tmpfs of its own over <folder>/engramd); pass --no-huge-tmpfs to
    measure /dev/shm's own 4 KiB pages.
    """
    path = Path(tempfile.mkdtemp(prefix="engramd-bench-", dir="/dev/shm"))
    try:
        yield path
    finally:
        remove_shm_folder(path)  # and the huge-page tmpfs a daemon run as root mounts there


@contextlib.contextmanager
def huge_tmpfs(size_gib: float) -> Iterator[Path | None]:
    """A tmpfs mounted with huge=within_size (2 MiB pages), unmounted afterwards.

    Yields None where mounting is not permitted (needs root).
    """
    path = Path(tempfile.mkdtemp(prefix="engramd-bench-huge-", dir="/tmp"))
    options = f"size={int(size_gib * 1024) + 64}m,huge=within_size"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        path.rmdir()
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def any_shm(huge: bool, size_gib: float) -> contextlib.AbstractContextManager[Path | None]:
    """A huge-page tmpfs or a plain /dev/shm folder."""
    return huge_tmpfs(size_gib) if huge else shm_folder()


def drop_page_cache(folder: Path) -> None:
    """Evict a folder's files from the page cache (cold reads)."""
    evict(folder)


def drop_caches() -> None:
    """Write dirty pages back and drop the whole page cache (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def sequential_read(files: list[Path], chunk: int = 16 << 20) -> float:
    """GB/s of one buffered sequential read of `files`, `chunk` bytes a call, in order."""
    total = 0
    buffer = bytearray(chunk)
    start = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as src:
            os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := src.readinto(buffer):
                total += n
    return total / (time.perf_counter() - start) / 1e9


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def as_json(figures: list[Figure]) -> dict[str, Any]:
    """Figures by name, for results/latest.json."""
    return {f.name: asdict(f) for f in figures}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (said) where the `bench` extra is
    not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no plot")
        return None
    return plt


def save_plot(fig: Any, ax: Any, path: Path) -> None:
    """Grid and legend on `ax`, then `fig` written to `path` (said)."""
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
