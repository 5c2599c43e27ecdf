"""Load throughput into tmpfs: engramd's loader against `cp`, and the strategies it chose from.

engramd's loader reads into a 2 MiB buffer, checksums it while it is in
cache, and writes it out (engramd/sets/loader.py). Beside it, on 1 and 2 threads,
the ways to move the bytes without a checksum: pwrite from a mapping of the
checkpoint, reads into a mapping of the tmpfs file, and sendfile. All
reserve with posix_fallocate first, as the loader does, so they differ only
in how the bytes move; the gap between them and the loader is the price of
the checksum.
"""

from __future__ import annotations

import mmap
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engramd.backings import TmpfsBacking
from engramd.sets.loader import LoadProgress, load_set
from engramd_client import plan_tables
from engramd_client.core.checkpoint import TablePlan, TensorEntry

from .common import Figure, compare, drop_page_cache, shm_folder, timed

CHUNK_BYTES = 64 << 20


def _pwrite_from_map(entry: TensorEntry, dst: int) -> None:
    with open(entry.file, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as src:
        view = memoryview(src)
        for done in range(0, entry.nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, entry.nbytes - done)
            os.pwrite(dst, view[entry.offset + done : entry.offset + done + n], done)
        view.release()


def _read_into_map(entry: TensorEntry, dst: int) -> None:
    with open(entry.file, "rb") as f, mmap.mmap(dst, entry.nbytes) as out:
        view = memoryview(out)
        for done in range(0, entry.nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, entry.nbytes - done)
            os.preadv(f.fileno(), [view[done : done + n]], entry.offset + done)
        view.release()


def _sendfile(entry: TensorEntry, dst: int) -> None:
    with open(entry.file, "rb") as f:
        done = 0
        while done < entry.nbytes:
            done += os.sendfile(
                dst, f.fileno(), entry.offset + done, min(CHUNK_BYTES, entry.nbytes - done)
            )


def _copy_with(
    copy: Callable[[TensorEntry, int], None], threads: int
) -> Callable[[TablePlan, Path], None]:
    def run(plan: TablePlan, shm: Path) -> None:
        fds = []
        for i, entry in enumerate(plan.tensors):
            fd = os.open(shm / f"{i}.bin", os.O_RDWR | os.O_CREAT, 0o640)
            if entry.nbytes:
                os.posix_fallocate(fd, 0, entry.nbytes)
            fds.append(fd)
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    copy,
                    [t for t in plan.tensors if t.nbytes],
                    [fd for fd, t in zip(fds, plan.tensors, strict=True) if t.nbytes],
                )
            )
        for fd in fds:
            os.close(fd)

    return run


def _engramd(threads: int) -> Callable[[TablePlan, Path], None]:
    def run(plan: TablePlan, shm: Path) -> None:
        backing = TmpfsBacking(str(shm), None)
        backing.claim()
        load_set(plan, backing, threads, LoadProgress(plan.nbytes))

    return run


def _cp(plan: TablePlan, shm: Path) -> None:
    files = sorted({str(t.file) for t in plan.tensors})
    subprocess.run(["cp", *files, str(shm)], check=True)


#: What `engramd serve` does by default (--load-threads 2).
DEFAULT = "engramd loader (with xxh3), 2 threads"


def _warm(ckpt: Path) -> None:
    for f in ckpt.iterdir():
        with open(f, "rb") as src:
            while src.read(64 << 20):
                pass


def load_throughput(ckpt: Path, reps: int) -> list[Figure]:
    """GB/s of each way into the same tmpfs, alternating them, warm and cold page cache."""
    plan = plan_tables(ckpt)
    cp_bytes = sum(f.stat().st_size for f in {t.file for t in plan.tensors})
    ways: dict[str, tuple[Callable[[TablePlan, Path], None], int]] = {
        "cp": (_cp, cp_bytes),
        DEFAULT: (_engramd(2), plan.nbytes),
        "engramd loader (with xxh3), 1 thread": (_engramd(1), plan.nbytes),
        "sendfile, 1 thread": (_copy_with(_sendfile, 1), plan.nbytes),
        "sendfile, 2 threads": (_copy_with(_sendfile, 2), plan.nbytes),
        "pwrite from mapping, 1 thread": (_copy_with(_pwrite_from_map, 1), plan.nbytes),
        "pwrite from mapping, 2 threads": (_copy_with(_pwrite_from_map, 2), plan.nbytes),
        "read into mapping, 1 thread": (_copy_with(_read_into_map, 1), plan.nbytes),
        "read into mapping, 2 threads": (_copy_with(_read_into_map, 2), plan.nbytes),
    }
    figures = []
    for cache in ("warm", "cold"):
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(reps if cache == "warm" else max(1, reps // 2)):
            for name, (way, nbytes) in ways.items():
                if cache == "cold":
                    drop_page_cache(ckpt)
                else:
                    _warm(ckpt)
                rates[name].append(nbytes / _scratch(way, plan) / 1e9)
        for name, samples in rates.items():
            print(f"  {cache} {name}: {sorted(samples)[len(samples) // 2]:.2f} GB/s", flush=True)
            if name == "cp":
                continue
            figures.append(
                compare(
                    f"load {cache}: {name}",
                    "GB/s",
                    samples,
                    rates["cp"],
                    higher_is_better=True,
                    target=">= 1.0x cp" if name == DEFAULT and cache == "warm" else "",
                    at_least=1.0 if name == DEFAULT and cache == "warm" else None,
                )
            )
    return figures


def _scratch(way: Callable[[TablePlan, Path], None], plan: TablePlan) -> float:
    """Seconds `way` takes to copy the plan into a fresh shm folder (removed afterwards)."""
    with shm_folder() as shm:
        return timed(lambda: way(plan, shm))
