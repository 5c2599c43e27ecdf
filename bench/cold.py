"""Cold loads against the device: engramd's load beside the fastest reads of the same files.

Each turn drops the page cache before each side and runs, in this order:

- direct: fio reading the files with O_DIRECT, 1 MiB requests, 32 in flight
  (io_uring, else libaio); where fio is missing, the bench's own reader does
  the same on 32 threads (one 1 MiB `preadv` each, O_DIRECT);
- buffered: one sequential read of the files, 16 MiB a call, as `cat` reads;
- parallel: the files read buffered in engramd's reads (sized to the
  device, `reads_for`) on as many threads as engramd loads on, handed out in
  order (engramd's reads without its set: what this device gives many
  buffered readers);
- NIXL POSIX: the same reads through NIXL's POSIX backend on io_uring (the
  wheel engramd ships), into a tmpfs file's shared mapping as engramd
  reads, all posted at once and polled 1 ms apart: an asynchronous I/O
  engine in place of the loader's threads;
- engramd in-process: the daemon's loader (`load_set`) into its default
  backing with its default reads, timed as the daemon times `load_seconds`,
  with its CPU seconds (user + system of every thread of the process) per GiB;
- engramd serve: what an operator meets, a fresh `engramd serve --checkpoint`
  on a new shm folder, timed from its start to health's SERVING (the
  configured set loaded), with its own `load_seconds` and its CPU seconds
  from exec to ready; as root it mounts its huge-page tmpfs, and again with
  --no-huge-tmpfs (the systemd unit's user, who may not mount: /dev/shm's
  own pages);
- idle: the same start (with its huge-page mount) after the machine sat
  IDLE_S seconds with the page cache dropped, beside the first touch of as
  much memory after the same idle time (a file of the set's size on the
  huge-page tmpfs, populated on every core): on a VM that hands free memory
  back to its host, what the set's pages cost before a byte is read.

Beside it, the reservation of one file (`reservation`): a memfd's pages
allocated by posix_fallocate (one thread: it holds the inode's lock) against
engramd's slices populated on every core (reserve_files, as it reserves
hugetlb files and, from POPULATE_CORES cores, shmem ones); and the same with
the pages zeroed too, as the copy's first touch zeroes what fallocate left
(on every core, as the copy threads would).

Memory is recycled before the in-process load, untimed, as in bench/load.py
(this VM backs memory it has not touched for a while slowly); the fresh
daemon started at once gets the memory the steps before it freed a moment
earlier, the one started after IDLE_S memory its VM handed back. The
device's figure of a turn is the faster of direct and buffered (the
target's); the parallel read is engramd's own reads without the set,
beside it. Each ratio is one turn's, their median
the figure.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engramd.backings import TmpfsBacking
from engramd.config import DaemonConfig
from engramd.fleet.nixlxfer import nixl_build
from engramd.host.blocking import cores
from engramd.host.reserve import reserve_files
from engramd.sets.loader import LoadProgress, load_set, reads_for
from engramd_client import plan_tables
from engramd_shared.layout import sets_root

from .common import (
    Figure,
    GiB,
    MiB,
    compare,
    cpu_seconds,
    daemon,
    drop_caches,
    sequential_read,
    shm_folder,
)
from .load import recycle

#: The direct reader's request size and requests in flight.
BLOCK, DEPTH = 1 * MiB, 32
#: Seconds a machine sits idle before the last start of a turn: a VM with free page
#: reporting (virtio-balloon) hands free memory back to its host within about 2 s.
IDLE_S = 10.0


def _fio(files: list[Path]) -> float:
    """GB/s of fio reading `files` with O_DIRECT."""
    for engine in ("io_uring", "libaio"):
        run = subprocess.run(
            [
                "fio",
                "--name=cold",
                "--rw=read",
                "--direct=1",
                f"--bs={BLOCK}",
                f"--iodepth={DEPTH}",
                f"--ioengine={engine}",
                "--output-format=json",
                "--filename=" + ":".join(str(f) for f in files),
            ],
            capture_output=True,
            text=True,
        )
        if run.returncode == 0:
            read = json.loads(run.stdout)["jobs"][0]["read"]
            return float(read["io_bytes"]) / (read["runtime"] / 1000) / 1e9
    raise RuntimeError(f"fio failed: {run.stderr.strip()}")


def _threaded_read(files: list[Path], threads: int, block: int, flags: int = 0) -> float:
    """GB/s of `threads` threads reading `files` in `block` requests handed out in order, each
    into a page-aligned buffer of its own (as O_DIRECT needs), the files opened with `flags`."""
    work = iter([(f, at) for f in files for at in range(0, f.stat().st_size, block)])
    fds = {f: os.open(f, os.O_RDONLY | flags) for f in files}
    lock = threading.Lock()

    def reader() -> None:
        buffer = mmap.mmap(-1, block)
        try:
            while True:
                with lock:
                    request = next(work, None)
                if request is None:
                    return
                os.preadv(fds[request[0]], [buffer], request[1])
        finally:
            buffer.close()

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    start = time.perf_counter()
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(f.stat().st_size for f in files) / (time.perf_counter() - start) / 1e9


def _nixl_posix(files: list[Path], read: int) -> float:
    """GB/s of NIXL's POSIX backend (io_uring) reading `files` in `read` requests into a
    tmpfs file's shared mapping (make setup installs NIXL)."""
    api: Any = importlib.import_module(f"{nixl_build()}._api")
    agent = api.nixl_agent(
        "engramd-bench-cold", api.nixl_agent_config(enable_prog_thread=False, backends=[])
    )
    agent.create_backend("POSIX", {"use_uring": "true"})
    sizes = [f.stat().st_size for f in files]
    fds = [os.open(f, os.O_RDONLY) for f in files]
    with shm_folder() as shm:
        maps = []
        for i, size in enumerate(sizes):
            out = os.open(shm / f"t{i}", os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(out, 0, size)
            maps.append(mmap.mmap(out, size))
            os.close(out)
        try:
            addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
            regs = [
                agent.register_memory(
                    [(a, n, 0, "") for a, n in zip(addrs, sizes, strict=True)], "DRAM"
                ),
                agent.register_memory(
                    [(0, n, fd, "") for fd, n in zip(fds, sizes, strict=True)], "FILE"
                ),
            ]
            start = time.perf_counter()
            handles = [
                agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(
                        [(a + o, min(read, n - o), 0) for o in range(0, n, read)], "DRAM"
                    ),
                    agent.get_xfer_descs(
                        [(o, min(read, n - o), fd) for o in range(0, n, read)], "FILE"
                    ),
                    agent.name,
                )
                for a, n, fd in zip(addrs, sizes, fds, strict=True)
            ]
            # Every transfer polled to its end, failed or not, before the mappings go.
            states = {h: agent.transfer(h) for h in handles}
            while any(state not in ("DONE", "ERR") for state in states.values()):
                time.sleep(0.001)
                states = {
                    h: state if state in ("DONE", "ERR") else agent.check_xfer_state(h)
                    for h, state in states.items()
                }
            seconds = time.perf_counter() - start
            for h in handles:
                agent.release_xfer_handle(h)
            for reg in regs:
                agent.deregister_memory(reg)
            if "ERR" in states.values():
                raise RuntimeError("a NIXL POSIX read failed")
        finally:
            for m in maps:
                m.close()
            for fd in fds:
                os.close(fd)
    return sum(sizes) / seconds / 1e9


def _reserve_seconds(nbytes: int, fallocate: bool, zeroed: bool) -> float:
    """Seconds to allocate (and with `zeroed` also zero) a memfd's `nbytes` of 4 KiB pages."""
    fd = os.memfd_create("engramd-bench-reserve", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        start = time.perf_counter()
        if not fallocate:
            reserve_files([(fd, nbytes)], mmap.PAGESIZE, populate=True)
            return time.perf_counter() - start
        os.posix_fallocate(fd, 0, nbytes)
        if zeroed:
            # The copy's first touch, on every core: populating fallocate's pages zeroes them.
            reserve_files([(fd, nbytes)], mmap.PAGESIZE, populate=True)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def reservation(gib: float, turns: int) -> list[Figure]:
    """One file's pages reserved: posix_fallocate on one thread against engramd's, on every
    core; then with the pages zeroed as the copy needs them."""
    nbytes = int(gib * GiB) // mmap.PAGESIZE * mmap.PAGESIZE
    figures = []
    for zeroed in (False, True):
        ours, theirs = [], []
        for _ in range(turns):
            theirs.append(nbytes / _reserve_seconds(nbytes, True, zeroed) / 1e9)
            ours.append(nbytes / _reserve_seconds(nbytes, False, zeroed) / 1e9)
        what = "allocated and zeroed" if zeroed else "allocated"
        figures.append(
            compare(
                f"one {gib:g} GiB memfd {what}: engramd vs posix_fallocate",
                "GB/s",
                ours,
                theirs,
                higher_is_better=True,
                paired=True,
                note=f"4 KiB pages; engramd on {cores()} cores"
                + ("; zeroed: fallocate's pages then touched on every core" if zeroed else ""),
            )
        )
    return figures


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _default_backing() -> Iterator[TmpfsBacking]:
    """The daemon's default backing over a new shm folder, claimed (as root it mounts its
    huge-page tmpfs: untimed, the daemon does it once) and released afterwards."""
    with shm_folder() as shm:
        backing = TmpfsBacking(str(shm), None, huge_tmpfs=DaemonConfig().huge_tmpfs)
        backing.claim()
        try:
            yield backing
        finally:
            backing.release()


def _engramd(ckpt: Path) -> tuple[float, float]:
    """(GB/s, CPU seconds per GiB) of the daemon's loader reading `ckpt` cold."""
    plan = plan_tables(ckpt)
    with _default_backing() as backing:
        recycle(plan.nbytes)
        drop_caches()
        cpu, start = _cpu(), time.perf_counter()
        load_set(plan, backing, DaemonConfig().load_threads, LoadProgress(plan.nbytes))
        seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    return plan.nbytes / seconds / 1e9, cpu / (plan.nbytes / GiB)


def _serve(ckpt: Path, huge: bool, idle: float = 0.0) -> tuple[float, float, float, float]:
    """A fresh `engramd serve --checkpoint ckpt` over a new shm folder, caches dropped and then
    `idle` seconds: (GB/s exec to ready, GB/s of its `load_seconds`, seconds exec to socket,
    CPU seconds per GiB from its socket's appearance to ready)."""
    nbytes = plan_tables(ckpt).nbytes
    with shm_folder() as shm:
        drop_caches()
        time.sleep(idle)
        start = time.perf_counter()
        with daemon(
            shm, "--checkpoint", str(ckpt), *([] if huge else ["--no-huge-tmpfs"]), wait="no"
        ) as d:
            while not d.socket.exists():
                if d.proc is not None and d.proc.poll() is not None:
                    raise RuntimeError(f"engramd exited:\n{d.log}")
                time.sleep(0.002)
            bound, cpu = time.perf_counter() - start, cpu_seconds(d.pid)
            d.wait(serving=True)
            seconds, cpu = time.perf_counter() - start, cpu_seconds(d.pid) - cpu
            [ts] = d.status().sets
            if huge and ts.page_size != 2 * MiB:
                raise RuntimeError(f"the daemon's set is on pages of {ts.page_size} bytes")
    return nbytes / seconds / 1e9, nbytes / ts.load_seconds / 1e9, bound, cpu / (nbytes / GiB)


def _first_touch(nbytes: int, idle: float) -> float:
    """GB/s of populating `nbytes` of a file on the daemon's huge-page tmpfs on every core,
    `idle` seconds after the page cache was dropped: what memory costs before any read."""
    with _default_backing() as backing:
        path = sets_root(backing.shm_dir) / "touched"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            drop_caches()
            time.sleep(idle)
            start = time.perf_counter()
            reserve_files([(fd, nbytes)], mmap.PAGESIZE, populate=True)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
            os.unlink(path)
    return nbytes / seconds / 1e9


def cold_loads(ckpt: Path, turns: int) -> list[Figure]:
    """engramd's cold load against the device's fastest read of the same files."""
    if os.geteuid() != 0:
        print("  cold: not measured (dropping the page cache needs root)", flush=True)
        return []
    files = sorted(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    fio = shutil.which("fio") is not None
    direct_name = "fio direct" if fio else "direct reader (fio missing)"
    plan = plan_tables(ckpt)
    reads = reads_for(plan, DaemonConfig().load_threads)
    threads = reads.threads
    print(
        f"  engramd's reads: {reads.size // MiB} MiB, {threads} in flight "
        f"({reads.device or 'no device'})"
    )
    direct, buffered, parallel, uring, ours, cpus = [], [], [], [], [], []
    # A fresh daemon, with its huge-page mount and without: start to ready, load_seconds, CPU.
    serve: dict[bool, tuple[list[float], list[float], list[float], list[float]]] = {
        True: ([], [], [], []),
        False: ([], [], [], []),
    }
    # The same after the machine sat idle, and what first touching memory costs then.
    idled: tuple[list[float], list[float], list[float], list[float]] = ([], [], [], [])
    touched: list[float] = []
    print(
        f"  turn  {direct_name:>26}  buffered 16 MiB  buffered, {threads} threads"
        f"  NIXL POSIX  engramd ({threads} threads)  CPU  ratio  ratio to {threads} readers"
    )
    for turn in range(turns):
        drop_caches()
        direct.append(_fio(files) if fio else _threaded_read(files, DEPTH, BLOCK, os.O_DIRECT))
        drop_caches()
        buffered.append(sequential_read(files))
        drop_caches()
        parallel.append(_threaded_read(files, threads, reads.size))
        drop_caches()
        uring.append(_nixl_posix(files, reads.size))
        rate, cpu = _engramd(ckpt)
        ours.append(rate)
        cpus.append(cpu)
        for huge, figures in serve.items():
            for figure, value in zip(figures, _serve(ckpt, huge), strict=True):
                figure.append(value)
        for figure, value in zip(idled, _serve(ckpt, True, IDLE_S), strict=True):
            figure.append(value)
        touched.append(_first_touch(plan.nbytes, IDLE_S))
        device = max(direct[-1], buffered[-1])
        print(
            f"  {turn:>4}  {direct[-1]:>21.2f} GB/s  {buffered[-1]:>10.2f} GB/s"
            f"  {parallel[-1]:>14.2f} GB/s  {uring[-1]:>5.2f} GB/s"
            f"  {rate:>15.2f} GB/s  {cpu:.2f} s/GiB"
            f"  {rate / device:.2f}x  {rate / parallel[-1]:.2f}x",
            flush=True,
        )
        for huge, (ready, loaded, bound, serve_cpu) in serve.items():
            print(
                f"        engramd serve{'' if huge else ' --no-huge-tmpfs'}: start to ready "
                f"{ready[-1]:.2f} GB/s ({ready[-1] / device:.2f}x), its load_seconds "
                f"{loaded[-1]:.2f} GB/s ({loaded[-1] / device:.2f}x), socket after "
                f"{bound[-1]:.2f} s, {serve_cpu[-1]:.2f} CPU-s/GiB from then",
                flush=True,
            )
        print(
            f"        after {IDLE_S:g} s idle: engramd serve's load_seconds {idled[1][-1]:.2f} "
            f"GB/s, {idled[3][-1]:.2f} CPU-s/GiB; memory's first touch {touched[-1]:.2f} GB/s",
            flush=True,
        )
    best = [max(d, b) for d, b in zip(direct, buffered, strict=True)]
    size = f"{sum(f.stat().st_size for f in files) / GiB:.1f} GiB"
    return [
        compare(
            f"cold load ({size}): engramd vs the device's fastest read",
            "GB/s",
            ours,
            best,
            higher_is_better=True,
            target=">= 0.95x",
            at_least=0.95,
            paired=True,
            note=f"the faster of {direct_name} and a buffered 16 MiB read, each turn",
        ),
        *(
            compare(
                f"cold start ({size}): engramd serve{flag}, {what} vs the device",
                "GB/s",
                rates,
                best,
                higher_is_better=True,
                target=">= 0.95x",
                at_least=0.95,
                paired=True,
                note=f"a fresh daemon on a new shm folder; its socket after "
                f"{statistics.median(bound):.2f} s",
            )
            for flag, (ready, loaded, bound, _) in (
                ("", serve[True]),
                (" --no-huge-tmpfs", serve[False]),
            )
            for what, rates in (("its load_seconds", loaded), ("exec to SERVING", ready))
        ),
        compare(
            f"cold start ({size}) after {IDLE_S:g} s idle: engramd serve's load_seconds vs "
            "the first touch of as much memory",
            "GB/s",
            idled[1],
            touched,
            higher_is_better=True,
            paired=True,
            note=f"the page cache dropped, then {IDLE_S:g} s idle before each; the first "
            "touch: a file of the set's size on the huge-page tmpfs populated on every core; "
            f"the daemon's CPU {statistics.median(idled[3]):.2f} s/GiB",
        ),
        compare(
            f"cold start ({size}): engramd serve's CPU per GiB vs the in-process load's",
            "s/GiB",
            serve[True][3],
            cpus,
            higher_is_better=False,
            target="within 1.5x",
            at_least=1 / 1.5,
            paired=True,
            note="from its socket's appearance to ready, every thread of the daemon; "
            "with its huge-page mount",
        ),
        compare(
            f"cold load ({size}): engramd vs {threads} buffered readers",
            "GB/s",
            ours,
            parallel,
            higher_is_better=True,
            paired=True,
            note=f"the same {reads.size // MiB} MiB reads on {threads} threads into buffers: "
            "engramd without its set",
        ),
        compare(
            f"cold load ({size}): engramd vs NIXL POSIX on io_uring",
            "GB/s",
            ours,
            uring,
            higher_is_better=True,
            paired=True,
            note=f"the same {reads.size // MiB} MiB reads posted at once into a tmpfs mapping",
        ),
        compare(
            f"cold load ({size}): engramd's CPU per GiB",
            "s/GiB",
            cpus,
            None,
            higher_is_better=False,
            note=f"user + system of the loading process, {threads} threads",
        ),
    ]
