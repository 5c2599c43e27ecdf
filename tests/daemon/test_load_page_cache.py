"""A load leaves the node one copy of the tables: the bytes it read are dropped from the
page cache behind the reads, the rest of the checkpoint's files is left as it was."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engramd.host.pagecache import resident_bytes
from engramd_client import plan_tables

PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident(ranges: list[tuple[Path, int, int]]) -> int:
    total = 0
    for path, offset, nbytes in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            total += resident_bytes(fd, offset, nbytes)
        finally:
            os.close(fd)
    return total


def test_a_load_drops_the_tables_it_read_from_the_page_cache(
    checkpoint: Path, daemons: Any
) -> None:
    plan = plan_tables(checkpoint)
    spans = [(s.file, s.offset, s.nbytes) for t in plan.tensors for s in t.spans]
    # Each file's header, which the daemon reads too, and keeps cached.
    firsts: dict[Path, int] = {}
    for f, offset, _ in spans:
        firsts[f] = min(offset, firsts.get(f, offset))
    heads = [(f, 0, offset) for f, offset in firsts.items()]
    for f in {s[0] for s in spans}:
        with open(f, "rb") as src:
            # Written back first: the kernel drops only clean pages (a file just written
            # is still dirty, and its pages stay until written back).
            os.fsync(src.fileno())
            while src.read(1 << 20):
                pass
    tables = sum(n for _, _, n in spans)
    assert _resident(spans) == tables, "the checkpoint was not in the page cache to begin with"
    d = daemons("--checkpoint", str(checkpoint))
    [ts] = d.status().sets
    assert ts.state == "ready"
    # Only the pages a table shares with its neighbours at either end may stay.
    assert _resident(spans) <= 2 * PAGE * len(spans), "the tables are still in the page cache"
    assert _resident(heads) >= sum(n // PAGE * PAGE for _, _, n in heads), "headers dropped"
