"""disk_offload: a PLE table read each step from the daemon's disk copy, against the table held
resident and against vLLM main's mmap of the checkpoint.

    python -m bench --only offload [--offload-gib 1.5] [--reps 3]

One synthetic Qwen4Exp checkpoint (one PLE layer, fp8 rows of 64 bytes in 64
row shards over 4 files), one daemon with `--backing disk` holding its table
as one file. Each side gathers in a process of its own (bench/offload_worker.py):
(a) resident, a private tensor (the ceiling); (b) the disk_offload path,
engramd_client.rowread over the daemon's file, every page cached; (c) the
same in a memory cgroup whose page cache holds a quarter of the table; (d)
the same cold (the file's pages evicted before each measured run: the file's
share of `echo 3 > /proc/sys/vm/drop_caches`, which would also empty the
page cache of everyone else on the machine); (e) vLLM main's mmap shape
over the checkpoint's shard files, in the same three conditions as (b)-(d).

Steps are a decode size (256 tokens x HEADS ids) and a prefill size (8,192
tokens x HEADS ids), ids Zipf-like or uniform within each head's slice of
the table. Warm and quarter-cache sides gather for short windows, taking
turns in an order that rotates each turn, and each ratio is the median of
the ratios of one turn's windows (the CPU is shared: a slow moment hits
both sides of a ratio); cold sides take turns too, each run from an evicted
file, and the first cold step is also timed alone with the reader as an
engine reading warm leaves it (it learns a step was cold from that step).
Besides: the daemon's warm-up of the set (restart, evicted), each side's setup
to its first lookup (attach against loading the table resident),
four replicas' unique memory (USS) against the table, and the disk's own
floor for a cold step (its distinct pages read by 32 threads, nothing else).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engramd.testing.child import JsonLinesChild
from engramd.testing.daemon_process import DaemonProcess
from engramd.testing.pagecache import cached, evict
from engramd.testing.synth import PleSpec, synthesize_ple
from engramd_shared.checkpoint import plan_tables

from .common import Figure, GiB, compare, paired_ratio, shm_folder
from .offload_worker import POOL_STEPS, SIZES, step_ids

#: n-gram heads of the layer: ids per token.
HEADS = 8
#: Bytes per row: fp8, 64 values.
ROW_BYTES = 64
#: Seconds a warm or quarter-cache side gathers per window, by step size.
WINDOW_S = {"decode": 0.2, "prefill": 0.4}
#: Windows per side in a repetition (the turns rotate within).
ROUNDS = 4
#: Steps of a cold run, by step size: the first steps after the file's pages were evicted.
COLD_STEPS = {"decode": 16, "prefill": 2}
DISTS = ("zipf", "uniform")
#: Replicas for the memory figure.
REPLICAS = 4
#: Threads of the disk's floor (as vLLM main's pool).
FLOOR_THREADS = 32


def _spec(gib: float) -> PleSpec:
    rows = int(gib * GiB) // ROW_BYTES // (HEADS * 64) * (HEADS * 64)
    return PleSpec(layers=(0,), rows=rows, dim=ROW_BYTES, parts=64, fmt="F8_E4M3", files=4)


def _checkpoint(workdir: Path, gib: float) -> Path:
    """The synthetic checkpoint, made once per size in `workdir`."""
    folder = workdir / f"ple-offload-{gib:g}g"
    done = folder / ".complete"
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"  writing a {gib:g} GiB Qwen4Exp PLE checkpoint to {folder}", flush=True)
        synthesize_ple(folder, _spec(gib))
        done.touch()
    return folder


def _worker(
    role: str, ckpt: Path, socket: str, prefix: list[str] | None = None
) -> tuple[JsonLinesChild, float]:
    """A side's process, once it made its first lookup; and its seconds from setup to it."""
    args = [sys.executable, "-m", "bench.offload_worker", role, str(ckpt), socket, str(HEADS)]
    root = Path(__file__).resolve().parent.parent
    child = JsonLinesChild([*(prefix or []), *args], cwd=root)
    hello = child.read()
    assert hello.get("ready"), hello
    return child, float(hello["setup_s"])


def _evict_cold(dfile: Path, shards: list[Path], children: list[JsonLinesChild]) -> None:
    """The daemon's file and the checkpoint's shards out of the page cache: each child first
    unmaps its pages (an eviction, like drop_caches, spares pages a process maps)."""
    for child in children:
        child.ask("unmap")
    evict(dfile.parent, dfile.name)
    for shard in shards:
        evict(shard.parent, shard.name)


def _close(children: list[JsonLinesChild]) -> None:
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(OSError):
                c.send("exit")
            try:
                c.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def _rate(child: JsonLinesChild, command: str) -> float:
    doc = child.ask(command)
    return float(doc["rows"]) / float(doc["seconds"]) / 1e6


def _turns(
    sides: dict[str, JsonLinesChild], size: str, dist: str, turns: int
) -> dict[str, list[float]]:
    """Mrows/s of each side, window by window, the order rotating each turn."""
    names = list(sides)
    for child in sides.values():  # every step of the pool once: its pages in the page tables
        child.ask(f"steps {size} {dist} 0 {POOL_STEPS[size]}")
    rates: dict[str, list[float]] = {n: [] for n in names}
    for turn in range(turns):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            rates[name].append(_rate(sides[name], f"window {size} {dist} {WINDOW_S[size]}"))
    return rates


def _uss(pid: int) -> int:
    """Bytes only this process maps (smaps_rollup's private pages)."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Private_Clean", "Private_Dirty", "Private_Hugetlb"):
            total += int(value.split()[0]) * 1024
    return total


@contextlib.contextmanager
def _memory_cgroup() -> Iterator[Path]:
    """A new v1 or v2 memory cgroup with no limit yet; removed afterwards."""
    name = f"engramd-bench-{os.getpid()}-{secrets.token_hex(3)}"
    for root, limit_file in (
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ):
        # A cgroup hierarchy, not a plain folder (v1 mounts a tmpfs at /sys/fs/cgroup).
        if not (root / "cgroup.procs").exists():
            continue
        folder = root / name
        try:
            folder.mkdir()
        except OSError:
            continue
        if (folder / limit_file).exists():
            break
        folder.rmdir()
    else:
        raise RuntimeError("no memory cgroup can be made here (needs root, cgroup v1 or v2)")
    try:
        yield folder
    finally:
        deadline = time.monotonic() + 30
        while subprocess.run(["rmdir", str(folder)], capture_output=True).returncode:
            if time.monotonic() > deadline:
                print(f"  could not remove the cgroup {folder}", flush=True)
                break
            time.sleep(0.05)


def _limit_files(group: Path) -> tuple[Path, Path]:
    if (group / "memory.max").exists():
        return group / "memory.max", group / "memory.current"
    return group / "memory.limit_in_bytes", group / "memory.usage_in_bytes"


def _daemon_file(disk: Path) -> Path:
    [path] = [p for p in disk.rglob("*") if p.is_file() and p.stat().st_size > GiB // 8]
    return path


def _warm_up(d: DaemonProcess, disk: Path) -> tuple[float, float, str]:
    """The daemon's warm-up of its set from a cold page cache: restarted, evicted first.
    Returns (seconds to SERVING, seconds to warmed, the daemon's log line)."""
    d.stop()
    evict(disk)
    logged = len(d.log)
    started = time.perf_counter()
    d.start()
    serving = time.perf_counter() - started
    while True:
        [s] = d.status().sets
        if s.page_cache_warming not in ("", "waiting", "warming"):
            break
        time.sleep(0.05)
    warmed = time.perf_counter() - started
    line = next(
        (ln for ln in d.log[logged:].splitlines() if "warmed:" in ln or "warm-up stopped" in ln),
        "",
    )
    return serving, warmed, line.split("engramd: ", 1)[-1]


def _floor(path: Path, ids: torch.Tensor) -> tuple[float, int]:
    """A cold step's disk floor: its distinct pages read from the evicted file by
    FLOOR_THREADS threads (pread, nothing else). Returns (Mrows/s, pages)."""
    pages = torch.unique(ids * ROW_BYTES // 4096).tolist()
    evict(path.parent, path.name)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    chunks = [pages[i::FLOOR_THREADS] for i in range(FLOOR_THREADS)]

    def read(chunk: list[int]) -> None:
        for page in chunk:
            os.pread(fd, 4096, page * 4096)

    threads = [threading.Thread(target=read, args=(c,)) for c in chunks]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    os.close(fd)
    return ids.numel() / took / 1e6, len(pages)


def offload_figures(workdir: Path, gib: float, reps: int) -> list[Figure]:
    """Every figure of the disk_offload section (the module's docstring)."""
    figures: list[Figure] = []
    ckpt = _checkpoint(workdir, gib)
    [entry] = plan_tables(ckpt).tensors
    table = entry.nbytes
    rows = entry.shape[0]
    shards = sorted({p.file for p in entry.spans})
    disk = workdir / "offload-disk"
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir()
    sock_dir = Path(tempfile.mkdtemp(prefix="eo", dir="/tmp"))
    children: list[JsonLinesChild] = []
    with shm_folder() as shm:
        d = DaemonProcess(
            sock_dir / "d.sock",
            shm,
            ["--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(ckpt)],
            sock_dir / "log",
        )
        try:
            d.start()
            socket = str(d.socket)
            dfile = _daemon_file(disk)
            print(f"  table: {table / GiB:.2f} GiB, {rows:,} rows of {ROW_BYTES} B", flush=True)
            serving, warmed, line = _warm_up(d, disk)
            print(f"  daemon restart, cold: SERVING in {serving:.2f} s; {line}", flush=True)
            figures.append(
                Figure(
                    "disk_offload: daemon restart from a cold page cache, until its set is warmed",
                    "s",
                    warmed,
                    target="reported; readiness does not wait for it",
                    note=f"SERVING after {serving:.2f} s; {line}",
                )
            )
            figures += _starts(ckpt, socket, shards, reps)
            # Warm: the daemon warmed its file; the resident side's load cached the checkpoint.
            resident, _ = _worker("resident", ckpt, socket)
            offload, _ = _worker("offload", ckpt, socket)
            vllm, _ = _worker("vllm-mmap", ckpt, socket)
            mapped, _ = _worker("mapped", ckpt, socket)
            children += [resident, offload, vllm, mapped]
            for size in SIZES:
                for dist in DISTS:
                    sides = {
                        "resident": resident,
                        "offload": offload,
                        "mapped": mapped,
                        "vllm-mmap": vllm,
                    }
                    r = _turns(sides, size, dist, reps * ROUNDS)
                    name = f"disk_offload {size} {dist}"
                    figures.append(
                        compare(
                            f"{name}: (b) page cache / (a) resident",
                            "Mrows/s",
                            r["offload"],
                            r["resident"],
                            higher_is_better=True,
                            target=">= 0.9x resident",
                            at_least=0.9,
                            paired=True,
                        )
                    )
                    figures.append(
                        compare(
                            f"{name}: the lease's mapping, bare index_select / (a) resident",
                            "Mrows/s",
                            r["mapped"],
                            r["resident"],
                            higher_is_better=True,
                            target="reported (what (b) costs without the reader)",
                            paired=True,
                        )
                    )
                    figures.append(
                        compare(
                            f"{name}: (b) page cache / (e) vLLM mmap, cached",
                            "Mrows/s",
                            r["offload"],
                            r["vllm-mmap"],
                            higher_is_better=True,
                            target="reported",
                            paired=True,
                        )
                    )
                    print(
                        f"  warm {size} {dist}: resident "
                        f"{statistics.median(r['resident']):.2f}, offload "
                        f"{statistics.median(r['offload']):.2f}, bare mapping "
                        f"{statistics.median(r['mapped']):.2f}, vLLM mmap "
                        f"{statistics.median(r['vllm-mmap']):.2f} Mrows/s",
                        flush=True,
                    )
            figures.append(_replicas(ckpt, socket, dfile, table, offload, resident))
            _close([resident, mapped])
            figures += _quarter(ckpt, socket, dfile, shards, table, reps, [offload, vllm])
            figures += _cold(offload, vllm, dfile, shards, rows, table, reps)
        finally:
            _close(children)
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    return figures


def _starts(ckpt: Path, socket: str, shards: list[Path], reps: int) -> list[Figure]:
    """Setup to the first decode lookup: attach to the daemon's disk copy (warmed by the
    daemon), against loading the table resident from the checkpoint, its files cached (the
    resident side's best case) and evicted (an engine's first start after a reboot)."""
    took: dict[str, list[float]] = {"offload": [], "resident": [], "resident, cold": []}
    for turn in range(reps):
        names = list(took)
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            if name == "resident, cold":
                for shard in shards:
                    evict(shard.parent, shard.name)
            child, setup_s = _worker(name.split(",")[0], ckpt, socket)
            took[name].append(setup_s)
            _close([child])
    print(
        "  setup to the first lookup: "
        + ", ".join(f"{n} {statistics.median(t):.3f} s" for n, t in took.items()),
        flush=True,
    )
    return [
        compare(
            "disk_offload: table setup to first lookup, (b) attach / (a) resident load, "
            "checkpoint evicted",
            "s",
            took["offload"],
            took["resident, cold"],
            higher_is_better=False,
            target="reported",
            paired=True,
        ),
        compare(
            "disk_offload: table setup to first lookup, (b) attach / (a) resident load, "
            "checkpoint cached",
            "s",
            took["offload"],
            took["resident"],
            higher_is_better=False,
            target=">= 10x faster",
            at_least=10,
            paired=True,
        ),
    ]


def _replicas(
    ckpt: Path,
    socket: str,
    dfile: Path,
    table: int,
    first: JsonLinesChild,
    resident: JsonLinesChild,
) -> Figure:
    """Four replicas gathering: each one's USS growth against the table; the node's memory."""
    replicas = [first] + [_worker("offload", ckpt, socket)[0] for _ in range(REPLICAS - 1)]
    try:
        before = [_uss(c.proc.pid) for c in replicas]
        for c in replicas:
            for size in SIZES:
                for dist in DISTS:
                    c.ask(f"window {size} {dist} 0.5")
        after = [_uss(c.proc.pid) for c in replicas]
    finally:
        _close(replicas[1:])
    growth = max(a - b for a, b in zip(after, before, strict=True))
    share = growth / table
    node = cached(dfile.parent, dfile.name) + sum(after)
    resident_uss = _uss(resident.proc.pid)
    note = (
        f"{REPLICAS} replicas: USS {', '.join(f'{u / 2**20:.0f}' for u in after)} MiB "
        f"(each grew at most {growth / 2**20:.1f} MiB while gathering); page cache of the "
        f"daemon's file {cached(dfile.parent, dfile.name) / GiB:.2f} GiB; node "
        f"{node / GiB:.2f} GiB against {REPLICAS} resident replicas' "
        f"{REPLICAS * resident_uss / GiB:.2f} GiB (USS {resident_uss / GiB:.2f} GiB each)"
    )
    print(f"  {note}", flush=True)
    return Figure(
        f"disk_offload: {REPLICAS} replicas, largest USS growth / table",
        "%",
        100 * share,
        None,
        None,
        "< 2% of the table",
        share < 0.02,
        note=note,
    )


def _quarter(
    ckpt: Path,
    socket: str,
    dfile: Path,
    shards: list[Path],
    table: int,
    reps: int,
    warm: list[JsonLinesChild],
) -> list[Figure]:
    """(c) and (e) each in a memory cgroup whose page cache holds a quarter of the table."""
    figures: list[Figure] = []
    with _memory_cgroup() as g_off, _memory_cgroup() as g_vllm:
        children: list[JsonLinesChild] = []
        try:
            _evict_cold(dfile, shards, warm)
            left = cached(dfile.parent, dfile.name) / table
            assert left < 0.05, f"{left:.0%} of the daemon's file stayed cached"
            sides: dict[str, JsonLinesChild] = {}
            for role, group in (("offload", g_off), ("vllm-mmap", g_vllm)):
                join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
                child, _ = _worker(role, ckpt, socket, prefix=["sh", "-c", join, "sh"])
                children.append(child)
                limit, usage = _limit_files(group)
                limit.write_text(str(int(usage.read_text()) + table // 4))
                sides[role] = child
            for size in SIZES:
                for dist in DISTS:
                    for child in sides.values():  # to the steady state: a quarter cached
                        child.ask(f"window {size} {dist} 1.0")
                    r = _turns(sides, size, dist, reps * ROUNDS)
                    held = cached(dfile.parent, dfile.name) / table
                    figures.append(
                        compare(
                            f"disk_offload {size} {dist}: (c) quarter cached / (e) vLLM mmap, "
                            "quarter cached",
                            "Mrows/s",
                            r["offload"],
                            r["vllm-mmap"],
                            higher_is_better=True,
                            target=">= 1.0x (aim 1.5x)",
                            at_least=1.0,
                            paired=True,
                            note=f"the daemon's file {held:.0%} cached in the cgroup",
                        )
                    )
                    print(
                        f"  quarter {size} {dist}: offload "
                        f"{statistics.median(r['offload']):.3f}, vLLM mmap "
                        f"{statistics.median(r['vllm-mmap']):.3f} Mrows/s "
                        f"({held:.0%} of the file cached)",
                        flush=True,
                    )
        finally:
            _close(children)
    return figures


def _cold(
    offload: JsonLinesChild,
    vllm: JsonLinesChild,
    dfile: Path,
    shards: list[Path],
    rows: int,
    table: int,
    reps: int,
) -> list[Figure]:
    """(d) and (e) from evicted files: the first COLD_STEPS steps, turns alternating (the
    reader as the last run left it, reading cold); then the first step alone after the cache
    was dropped under an engine reading warm."""
    figures: list[Figure] = []
    for size in SIZES:
        firsts: dict[str, list[float]] = {"offload": [], "vllm-mmap": []}
        for rep in range(reps):
            order = [("offload", offload), ("vllm-mmap", vllm)]
            for name, child in order if rep % 2 == 0 else order[::-1]:
                _evict_cold(dfile, shards, [offload, vllm])
                child.ask("as-warm")
                firsts[name].append(_rate(child, f"steps {size} uniform {100 + rep} 1"))
        figures.append(
            compare(
                f"disk_offload {size} uniform: (d) first cold step, reader warm until then / "
                "(e) its first cold step",
                "Mrows/s",
                firsts["offload"],
                firsts["vllm-mmap"],
                higher_is_better=True,
                target="reported",
                paired=True,
            )
        )
        print(
            f"  first cold {size} step after warm ones: offload "
            f"{statistics.median(firsts['offload']):.3f}, vLLM mmap "
            f"{statistics.median(firsts['vllm-mmap']):.3f} Mrows/s",
            flush=True,
        )
    for size in SIZES:
        for dist in DISTS:
            r: dict[str, list[float]] = {"offload": [], "vllm-mmap": []}
            left = 0.0
            for rep in range(reps):
                order = [("offload", offload), ("vllm-mmap", vllm)]
                for name, child in order if rep % 2 == 0 else order[::-1]:
                    _evict_cold(dfile, shards, [offload, vllm])
                    left = max(left, cached(dfile.parent, dfile.name) / table)
                    first = rep * COLD_STEPS[size]
                    r[name].append(_rate(child, f"steps {size} {dist} {first} {COLD_STEPS[size]}"))
            ids = step_ids(rows, HEADS, SIZES[size], dist, 0)
            _evict_cold(dfile, shards, [offload, vllm])
            floor, pages = _floor(dfile, ids)
            figures.append(
                compare(
                    f"disk_offload {size} {dist}: (d) cold / (e) vLLM mmap, cold",
                    "Mrows/s",
                    r["offload"],
                    r["vllm-mmap"],
                    higher_is_better=True,
                    target=">= 1.0x (aim 1.5x)",
                    at_least=1.0,
                    paired=True,
                    note=(
                        f"at most {left:.1%} of the daemon's file cached at a run's start; "
                        f"first step: {pages:,} distinct pages of {ids.numel():,} ids; the disk's "
                        f"floor (those pages by {FLOOR_THREADS} threads' preads) {floor:.3f} "
                        "Mrows/s"
                    ),
                )
            )
            print(
                f"  cold {size} {dist}: offload {statistics.median(r['offload']):.3f}, vLLM "
                f"mmap {statistics.median(r['vllm-mmap']):.3f} Mrows/s; "
                f"ratio {paired_ratio(r['offload'], r['vllm-mmap']):.2f}x; disk floor "
                f"{floor:.3f} Mrows/s ({pages:,} pages in the first step)",
                flush=True,
            )
    return figures
