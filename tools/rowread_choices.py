"""The choices of engramd_client.rowread measured side by side, on a table file in a folder.

    python tools/rowread_choices.py [--dir /tmp] [--rows 2000000] [--row-bytes 128]

Per step: the gather of a decode-sized (256 tokens x 8 heads) and a
prefill-sized (8,192 x 8) batch of ids, Zipf-like and uniform, warm (the file in
the page cache) and cold (its pages evicted with posix_fadvise(DONTNEED)
before each step), by each way the reader could read: one index_select over
the mapping, the same split over threads, with and without the readahead
hints for the step's runs of pages. Medians of a few steps, in rows per
second and as a ratio to a resident tensor's index_select.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engramd.testing.pagecache import evict_file
from engramd_client.rowread import HostRows, RowReader, _advise

_MADV_DONTNEED = 4


def _ids(kind: str, n: int, rows: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, rows, (n,), generator=g)
    # Zipf-like: rank r drawn with weight 1/r over a random permutation of the rows.
    ranks = torch.clamp((rows ** torch.rand(n, generator=g)).long() - 1, 0, rows - 1)
    perm_seed = 12345
    return (ranks * 2654435761 + perm_seed) % rows


def _evict(path: Path, rows: HostRows) -> None:
    # The file's pages leave the page cache only once no page table maps them.
    for piece in rows.pieces:
        _advise(piece.rows, _MADV_DONTNEED)
    evict_file(path)


#: The ways a step could read: threads the gather is split over, readahead hints or not.
WAYS = ((1, False), (16, False), (64, False), (1, True), (16, True), (64, True))


def _nothing() -> None:
    pass


def _read(
    reader: RowReader,
    ids: torch.Tensor,
    held: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    hints: bool,
) -> None:
    if hints:
        reader._hint(ids)
    reader._gather(ids, held, out, threads)


def _median(step: Callable[[], object], before: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--row-bytes", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    path = Path(args.dir) / f"rowread-choices-{os.getpid()}.bin"
    table = torch.randint(0, 256, (args.rows, args.row_bytes), dtype=torch.uint8, generator=g)
    path.write_bytes(table.numpy().tobytes())
    try:
        rows = HostRows.of_file(path, 0, args.rows, args.row_bytes)
        reader = RowReader(rows, 0, args.rows)
        print(f"table {args.rows} rows x {args.row_bytes} B ({rows.nbytes / 2**20:.0f} MiB)")
        print(
            f"{'ids':>8} {'dist':>8} {'state':>5} {'way':<22} {'ms':>8} {'Mrows/s':>8} x resident"
        )
        for n in (256 * 8, 8192 * 8):
            for kind in ("zipf", "uniform"):
                ids = _ids(kind, n, args.rows, g)
                out = torch.empty(n, args.row_bytes, dtype=torch.uint8)
                held = torch.ones(n, dtype=torch.bool)
                torch.index_select(table, 0, ids, out=out)
                resident = _median(
                    functools.partial(torch.index_select, table, 0, ids, out=out),
                    _nothing,
                    args.repeat,
                )
                for state in ("warm", "cold"):
                    before = functools.partial(_evict, path, rows) if state == "cold" else _nothing
                    reader._gather(ids, held, out, 1)
                    for threads, hints in WAYS:
                        if state == "warm" and hints:
                            continue
                        step = functools.partial(_read, reader, ids, held, out, threads, hints)
                        t = _median(step, before, args.repeat)
                        assert torch.equal(out, table[ids])
                        way = f"{'hints + ' if hints else ''}{threads} thread(s)"
                        print(
                            f"{n:>8} {kind:>8} {state:>5} {way:<22} {t * 1e3:8.2f} "
                            f"{n / t / 1e6:8.2f} {resident / t:6.2f}"
                        )
                print(f"{n:>8} {kind:>8} {'':>5} {'resident tensor':<22} {resident * 1e3:8.2f}")
        reader.close()
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
