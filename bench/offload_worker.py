"""One side of the disk_offload section (bench/offload.py), in a process of its own.

    python -m bench.offload_worker ROLE CHECKPOINT SOCKET HEADS

ROLE is how this process reads a PLE table's rows:

- resident: the table read from the checkpoint into a private tensor (the
  layout vLLM allocates; an in-memory gather, the ceiling);
- offload: engramd_client.rowread's RowReader over the daemon's disk-set
  file, attached through the daemon (the disk_offload path);
- mapped: the same lease's mapping gathered by a bare `index_select` (no
  ETP range, no cold detection): what the mapping costs without the reader;
- vllm-mmap: vLLM main's `ple_mmap.py` shape, written from its description
  (no code of it is installed here): a numpy memmap per checkpoint shard, a
  pool of 32 threads gathering each step's rows, `posix_fadvise(WILLNEED)`
  on the coalesced byte runs of the step's rows first.

It answers JSON lines (engramd.testing.child): first {"ready", "setup_s"}
(the seconds from the table's attach or load to the end of a first decode
gather), then one answer per command:

    window SIZE DIST SECONDS   gathers steps of the pool for SECONDS: rows, seconds
    steps SIZE DIST FIRST N    N steps of the pool from step FIRST: rows, seconds
    unmap                      drops the table's pages from this process's page tables
                               (MADV_DONTNEED), so that an eviction of the file's pages
                               (which spares mapped pages, as drop_caches does) empties it
    as-warm                    the reader's state as a warm engine's (RowReader.cold False:
                               it learns a step was cold from that step's major faults)
    exit
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from engramd.testing.child import say
from engramd_shared.checkpoint import plan_tables

#: ids per token: the n-gram heads of one PLE layer.
SIZES = {"decode": 256, "prefill": 8192}
#: Steps in each pool of index sets: more than a window gathers from the cache's reach.
POOL_STEPS = {"decode": 64, "prefill": 8}
#: The Zipf exponent of the skewed ids (rank r drawn with weight r ** -ZIPF_A).
ZIPF_A = 1.1
#: vLLM main's ple_mmap pool.
VLLM_THREADS = 32
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def unmap(address: int, length: int) -> None:
    """MADV_DONTNEED over the pages of [address, address + length) of a file mapping: this
    process maps none of them until it touches them again; the page cache keeps them."""
    start = address - address % mmap.PAGESIZE
    if _libc.madvise(start, address + length - start, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED)")


#: Byte gap under which two of a step's rows are one WILLNEED run (vLLM's coalescing).
COALESCE_BYTES = 64 << 10


def step_ids(rows: int, heads: int, tokens: int, dist: str, seed: int) -> torch.Tensor:
    """One step's ids: `tokens` x `heads`, head h's ids within its own slice of the table
    (PLE's per-head vocabularies), Zipf-like (hot ids scattered by a bijective hash) or
    uniform."""
    rng = np.random.default_rng(seed)
    span = rows // heads
    if dist == "uniform":
        local = rng.integers(0, span, size=(tokens, heads), dtype=np.int64)
    else:
        ranks = rng.zipf(ZIPF_A, size=(tokens, heads)).astype(np.int64) - 1
        # A rank's row: an odd multiplier mod the span, a bijection where span is a power of
        # two; else still a scatter of the hot ranks over the span.
        local = (ranks * 0x9E3779B1) % span
    ids = local + np.arange(heads, dtype=np.int64) * span
    return torch.from_numpy(ids.reshape(-1))


class Pools:
    """The steps each size and distribution cycles through; the same in every process."""

    def __init__(self, rows: int, heads: int) -> None:
        self.steps: dict[tuple[str, str], list[torch.Tensor]] = {}
        for size, tokens in SIZES.items():
            for dist in ("zipf", "uniform"):
                self.steps[(size, dist)] = [
                    step_ids(rows, heads, tokens, dist, seed) for seed in range(POOL_STEPS[size])
                ]


class Resident:
    """The table in private memory, read from the checkpoint's shards."""

    def __init__(self, checkpoint: Path) -> None:
        [entry] = plan_tables(checkpoint).tensors
        width = entry.nbytes // entry.shape[0]
        self.table = torch.empty(entry.shape[0], width, dtype=torch.uint8)
        flat = self.table.view(-1).numpy()
        at = 0
        for part in entry.spans:
            with open(part.file, "rb", buffering=0) as f:
                f.seek(part.offset)
                view = flat[at : at + part.nbytes].data
                while view:
                    n = f.readinto(view)
                    view = view[n:]
            at += part.nbytes

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(self.table, 0, ids, out=out)

    def unmap(self) -> None:
        raise ValueError("a resident table has no file pages")


class Offload:
    """RowReader over the daemon's disk-set file, attached through the daemon."""

    def __init__(self, checkpoint: Path, socket: str) -> None:
        from engramd_client import attach
        from engramd_client.rowread import HostRows, RowReader

        self.tables = attach(checkpoint, socket=socket, share=True)
        assert self.tables.mode == "shared", self.tables
        [name] = list(self.tables)
        self.table = table = self.tables[name]
        self.reader = RowReader(HostRows.of_tensor(table), 0, table.shape[0])

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.reader.gather(ids, out=out)

    def unmap(self) -> None:
        unmap(self.table.data_ptr(), self.table.nbytes)


class Mapped(Offload):
    """The lease's mapping of the daemon's file, gathered by a bare index_select."""

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        # fp8 rows as their bytes (one byte a value): the gather copies bytes.
        torch.index_select(self.table.view(torch.uint8), 0, ids, out=out)


class VllmMmap:
    """vLLM main's ple_mmap shape over the checkpoint's shard files."""

    def __init__(self, checkpoint: Path) -> None:
        [entry] = plan_tables(checkpoint).tensors
        self.width = entry.nbytes // entry.shape[0]
        self.maps: list[np.memmap] = []
        self.fds: list[int] = []
        self.offsets: list[int] = []
        starts = [0]
        for part in entry.spans:
            rows = part.nbytes // self.width
            self.maps.append(np.memmap(part.file, np.uint8, "r", part.offset, (rows, self.width)))
            self.fds.append(os.open(part.file, os.O_RDONLY))
            self.offsets.append(part.offset)
            starts.append(starts[-1] + rows)
        self.starts = np.array(starts, dtype=np.int64)
        self.pool = ThreadPoolExecutor(VLLM_THREADS)

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        flat = ids.numpy()
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        local = flat - self.starts[shard]
        self._willneed(shard, local)
        target = out.numpy()
        chunks = np.array_split(np.arange(len(flat)), VLLM_THREADS)

        def one(chunk: np.ndarray) -> None:
            for s in np.unique(shard[chunk]):
                mine = chunk[shard[chunk] == s]
                target[mine] = self.maps[s][local[mine]]

        list(self.pool.map(one, [c for c in chunks if len(c)]))

    def unmap(self) -> None:
        for m in self.maps:
            unmap(m.ctypes.data, m.nbytes)

    def _willneed(self, shard: np.ndarray, local: np.ndarray) -> None:
        for s in np.unique(shard):
            starts = np.sort(local[shard == s]) * self.width + self.offsets[s]
            # Runs of rows closer than COALESCE_BYTES: one hint each.
            breaks = np.nonzero(np.diff(starts) > COALESCE_BYTES)[0]
            firsts = np.concatenate(([0], breaks + 1))
            lasts = np.concatenate((breaks, [len(starts) - 1]))
            for a, b in zip(starts[firsts], starts[lasts], strict=True):
                os.posix_fadvise(
                    self.fds[s], int(a), int(b - a) + self.width, os.POSIX_FADV_WILLNEED
                )


def main() -> None:
    role, checkpoint, socket, heads = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    [entry] = plan_tables(checkpoint).tensors
    rows, width = entry.shape[0], entry.nbytes // entry.shape[0]
    pools = Pools(rows, heads)
    outs = {size: torch.zeros(t * heads, width, dtype=torch.uint8) for size, t in SIZES.items()}
    started = time.perf_counter()
    side: Resident | Offload | VllmMmap
    if role == "resident":
        side = Resident(checkpoint)
    elif role == "offload":
        side = Offload(checkpoint, socket)
    elif role == "mapped":
        side = Mapped(checkpoint, socket)
    else:
        side = VllmMmap(checkpoint)
    side.gather(pools.steps[("decode", "uniform")][0], outs["decode"])
    say({"ready": True, "setup_s": time.perf_counter() - started, "pid": os.getpid()})
    for line in sys.stdin:
        words = line.split()
        if words[0] == "exit":
            return
        if words[0] == "as-warm":
            if isinstance(side, Offload):
                side.reader.cold = False
            say({"cold": False})
            continue
        if words[0] == "unmap":
            side.unmap()
            say({"unmapped": True})
            continue
        size, dist = words[1], words[2]
        steps, out = pools.steps[(size, dist)], outs[size]
        done = 0
        if words[0] == "window":
            seconds = float(words[3])
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                side.gather(steps[done % len(steps)], out)
                done += 1
        else:
            first, count = int(words[3]), int(words[4])
            start = time.perf_counter()
            for i in range(first, first + count):
                side.gather(steps[i % len(steps)], out)
                done += 1
            elapsed = time.perf_counter() - start
        say({"rows": done * out.shape[0], "seconds": elapsed})


if __name__ == "__main__":
    main()
