"""Page sizes at the largest size this machine holds: 4 KiB, 2 MiB (tmpfs and hugetlb), 1 GiB.

For each side: the load against `cp` into tmpfs (warm), an attach and the
first T=4096 step after it, gathers T=1/64/4096 on 1 and 2 threads against
private tensors on 4 KiB pages (alternating), and the page-table bytes a
worker adds when it touches every page (VmPTE), extrapolated to 189 GiB.
hugetlb pages are reserved for the side and given back after; 1 GiB pages
come only as many as the kernel grants at run time, so that side measures
the largest set those pages hold and records the count.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engramd_client import Tables, attach, plan_tables
from engramd_shared.checkpoint import TablePlan

from .attach import wait_locked
from .common import Figure, GiB, MiB, checkpoint, compare, daemon, huge_tmpfs, shm_folder, timed
from .gather import Lookup
from .load import _cp, _warm
from .replicas import Replica

MODEL_GIB = 189
HUGEPAGES = Path("/sys/kernel/mm/hugepages")


def _vm_pte(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmPTE:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmPTE in /proc/PID/status")


@contextlib.contextmanager
def _reserved(page_size: int, pages: int) -> Iterator[int]:
    """Ask for `pages` more hugetlb pages; yields the grant, gives them back after.

    Memory is compacted first (and, for 1 GiB pages, the page cache dropped):
    a fragmented machine grants few huge pages at run time.
    """
    nr = HUGEPAGES / f"hugepages-{page_size >> 10}kB" / "nr_hugepages"
    old = int(nr.read_text())
    if page_size >= GiB:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    Path("/proc/sys/vm/compact_memory").write_text("1")
    nr.write_text(str(old + pages))
    try:
        yield int(nr.read_text()) - old
    finally:
        nr.write_text(str(old))


@contextlib.contextmanager
def _hugetlbfs(page_size: int) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="engramd-bench-hugetlbfs-", dir="/tmp"))
    subprocess.run(
        ["mount", "-t", "hugetlbfs", "-o", f"pagesize={page_size >> 10}K", "none", str(path)],
        check=True,
    )
    try:
        _first_touch(path, page_size)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def _first_touch(folder: Path, page_size: int) -> None:
    """Allocate every free page of the pool once and give it back, before any timing.

    On this VM the hypervisor backs a page the guest has just reserved only
    when the guest first touches it: the first fallocate of a fresh 1 GiB
    page took 2.4 s, the next ones 0.05-0.08 s (the kernel zeroing it). That
    is a cost of the VM, paid once per reservation, not of a load; the
    kernel's zeroing, which bare metal pays on every load, stays timed.
    """
    free = HUGEPAGES / f"hugepages-{page_size >> 10}kB" / "free_hugepages"
    scratch = folder / "first-touch"
    with open(scratch, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, int(free.read_text()) * page_size)
    scratch.unlink()


@contextlib.contextmanager
def _side(name: str, ckpt: Path) -> Iterator[Path | None]:
    gib = plan_tables(ckpt).nbytes / GiB
    if name == "tmpfs, 4 KiB pages":
        with shm_folder() as folder:
            yield folder
    elif name == "tmpfs, 2 MiB pages":
        with huge_tmpfs(gib + 0.1) as folder:
            yield folder
    elif name == "hugetlbfs, 1 GiB pages":
        with _hugetlbfs(GiB) as folder:  # from the pages huge_page_figures holds
            yield folder
    else:
        pages = int((gib * GiB + 64 * MiB) // (2 * MiB)) + 1
        with _reserved(2 * MiB, pages) as granted:
            if granted < pages:
                print(f"  {name}: asked for {pages} pages, the kernel granted {granted}")
                yield None
                return
            with _hugetlbfs(2 * MiB) as folder:
                yield folder


def huge_page_figures(workdir: Path, gib: float, reps: int) -> list[Figure]:
    """Every side at `gib` GiB of tables; 1 GiB pages at as many as the kernel grants.

    The 1 GiB pages are asked for first, while memory is least fragmented,
    and held through the other sides.
    """
    main = checkpoint(workdir, gib)
    with _reserved(GiB, 4) as granted:
        print(f"  1 GiB pages: asked for 4, the kernel granted {granted}", flush=True)
        sides = ["tmpfs, 4 KiB pages", "tmpfs, 2 MiB pages", "hugetlbfs, 2 MiB pages"]
        figures = _measure(main, sides, reps)
        if granted >= 1:
            one_gib = checkpoint(workdir, granted - 0.1)
            sides = ["hugetlbfs, 1 GiB pages"]
            figures += _measure(one_gib, sides, reps, note=f"{granted} pages granted")
    return figures


def _measure(ckpt: Path, sides: list[str], reps: int, note: str = "") -> list[Figure]:
    plan = plan_tables(ckpt)
    gib = plan.nbytes / GiB
    # The baseline first: a copy in tmpfs beside a reserved pool and the
    # private tensors would not fit this machine's memory.
    _warm(ckpt)
    cp_s = min(_cp_seconds(plan) for _ in range(2))
    private = attach(ckpt, share=False)
    figures: list[Figure] = []
    for side in sides:
        label = f"{side}, {gib:.1f} GiB" + (f" ({note})" if note else "")
        with _side(side, ckpt) as folder:
            if folder is None:
                continue
            _warm(ckpt)
            small = ["--no-huge-tmpfs"] if side == "tmpfs, 4 KiB pages" else []
            with daemon(folder, "--checkpoint", str(ckpt), *small) as d:
                [s] = d.status().sets
                load = s.bytes / s.load_seconds / 1e9
                figures.append(
                    compare(
                        f"load, {label}",
                        "GB/s",
                        [load],
                        [plan.nbytes / cp_s / 1e9],
                        higher_is_better=True,
                        target=">= 1.0x cp into tmpfs" if "hugetlbfs" in side else "reported",
                        at_least=1.0 if "hugetlbfs" in side else None,
                    )
                )
                wait_locked(d)
                figures += _latency(ckpt, str(d.socket), label)
                shared = attach(ckpt, socket=str(d.socket), share=True, populate=True)
                figures += _gathers(shared, private, label, side, reps)
                shared.close()
                figures.append(_page_tables(ckpt, str(d.socket), label, side, gib))
            print(f"  {label}: done", flush=True)
    private.close()
    return figures


def _cp_seconds(plan: TablePlan) -> float:
    with shm_folder() as folder:
        return _cp(plan, folder)


def _latency(ckpt: Path, socket: str, label: str) -> list[Figure]:
    attach_ms, first_ms = [], []
    for _ in range(5):
        start = time.perf_counter()
        tables = attach(ckpt, socket=socket, share=True)
        attach_ms.append((time.perf_counter() - start) * 1e3)
        lookup = Lookup(tables, 4096)
        first_ms.append(timed(lookup.step) * 1e3)
        tables.close()
    return [
        compare(
            f"attach and first T=4096 step, {label}",
            "ms",
            [a + f for a, f in zip(attach_ms, first_ms, strict=True)],
            None,
            higher_is_better=False,
            target="reported",
            note=f"attach {statistics.median(attach_ms):.1f} ms, first step "
            f"{statistics.median(first_ms):.1f} ms",
        )
    ]


def _gathers(shared: Tables, private: Tables, label: str, side: str, reps: int) -> list[Figure]:
    figures = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for tokens in (1, 64, 4096):
            sides = {"shared": Lookup(shared, tokens), "private": Lookup(private, tokens)}
            for lookup in sides.values():
                lookup.step()
            rates: dict[str, list[float]] = {"shared": [], "private": []}
            for rep in range(reps):
                for name in ["shared", "private"] if rep % 2 else ["private", "shared"]:
                    rates[name].append(sides[name].rate() / 1e6)
            goal = 1.3 if "1 GiB" in side and tokens == 4096 else None
            figures.append(
                compare(
                    f"gather T={tokens}, {threads} thread(s), {label}",
                    "Mrows/s",
                    rates["shared"],
                    rates["private"],
                    higher_is_better=True,
                    target=">= 1.3x private (4 KiB)" if goal else "reported (vs private 4 KiB)",
                    at_least=goal,
                )
            )
            print(f"  {figures[-1].name}: {figures[-1].ratio:.3f}x", flush=True)
    torch.set_num_threads(2)
    return figures


def _page_tables(ckpt: Path, socket: str, label: str, side: str, gib: float) -> Figure:
    replica = Replica(ckpt, socket, "shared")
    try:
        replica.attached = replica.read()
        before = _vm_pte(replica.proc.pid)
        replica.send("touch")
        replica.read()
        grown = _vm_pte(replica.proc.pid) - before
    finally:
        replica.stop()
    # Scaled by the page-table structure, not linearly: 1 GiB pages need one
    # table page per 512 GiB, so a few GiB measured would overstate 189 GiB.
    at_model = grown * _formula(side, MODEL_GIB) / _formula(side, gib)
    return compare(
        f"page tables per worker at {MODEL_GIB} GiB, {label}",
        "KiB",
        [at_model / 1024],
        None,
        higher_is_better=False,
        target="< 64 KiB" if "1 GiB" in side else "reported",
        at_most=64 if "1 GiB" in side else None,
        note=f"measured {grown / 1024:.0f} KiB of VmPTE for {gib:.1f} GiB touched; the "
        f"structure says {_formula(side, gib) / 1024:.0f} KiB there and "
        f"{_formula(side, MODEL_GIB) / 1024:.0f} KiB at {MODEL_GIB} GiB",
    )


def _formula(side: str, gib: float) -> float:
    """Page-table bytes to map `gib` GiB: 8-byte entries in 4 KiB table pages.

    4 KiB pages: a PTE page per 2 MiB and a PMD page per GiB above them;
    2 MiB pages: a PMD entry each, a PMD page per GiB; 1 GiB pages: a PUD
    entry each, a PUD page per 512 GiB.
    """
    if "4 KiB" in side:
        return gib * (512 + 1) * 4096
    if "2 MiB" in side:
        return gib * 4096
    return math.ceil(gib / 512) * 4096
