"""engramd.host.pagewarm: a file read into the page cache within a memory bound, stopped when
memory runs short or the daemon stops (a real file on the disk, its pages evicted first)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engramd.backings.disk import DiskBacking
from engramd.host import pagewarm
from engramd.host.memlimit import MemoryLimit
from engramd.host.pagewarm import CHUNK_BYTES, Span, headroom, memory_stall_pct, warm
from engramd.sets.tableset import SetState, TableSet
from engramd.sets.warming import PageCacheWarmer
from engramd.testing.pagecache import cached, evict
from engramd_shared.layout import Manifest, ManifestTensor

MiB = 1 << 20
SIZE = 64 * MiB


@pytest.fixture
def cold_file(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A 64 MiB file on the disk, out of the page cache, open for reading."""
    fstype = subprocess.run(
        ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True
    ).stdout.strip()
    if fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fstype}: its pages cannot be evicted")
    path = tmp_path / "table"
    path.write_bytes(os.urandom(SIZE))
    evict(tmp_path)
    assert cached(tmp_path) < SIZE / 20
    fd = os.open(path, os.O_RDONLY)
    # A sequential reader's readahead would bring in pages warm() did not ask for.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        yield path, fd
    finally:
        os.close(fd)


def _plenty() -> MemoryLimit:
    return MemoryLimit("test", 64 << 30, 32 << 30)


def _calm() -> float | None:
    """No stall: the node's own PSI moves with whatever else runs here."""
    return 0.0


def test_the_whole_file_is_read_in_when_memory_is_plenty(cold_file: tuple[Path, int]) -> None:
    path, fd = cold_file
    done = warm([Span(fd, 0, SIZE)], threading.Event(), _plenty, _calm)
    assert done.stopped == "" and done.total == SIZE
    assert done.read >= SIZE * 0.99 and done.skipped < SIZE / 20
    assert cached(path.parent) >= SIZE * 0.99
    # Again: everything is cached, nothing is read.
    again = warm([Span(fd, 0, SIZE)], threading.Event(), _plenty, _calm)
    assert again.stopped == "" and again.read == 0 and again.skipped >= SIZE * 0.99


def test_it_reads_no_more_than_the_available_memory_less_the_headroom(
    cold_file: tuple[Path, int],
) -> None:
    path, fd = cold_file
    # 256 MiB in all (headroom: an eighth, 32 MiB), 48 MiB available: 16 MiB may be read.
    bound = MemoryLimit("cgroup /x memory.limit_in_bytes", 256 * MiB, 48 * MiB)
    assert headroom(bound) == 32 * MiB
    done = warm([Span(fd, 0, SIZE)], threading.Event(), lambda: bound, _calm)
    assert done.stopped.startswith("memory bound: 16 MiB may be read"), done.stopped
    assert 8 * MiB <= cached(path.parent) <= 16 * MiB + CHUNK_BYTES


def test_it_stops_when_the_available_memory_falls_under_the_headroom(
    cold_file: tuple[Path, int],
) -> None:
    path, fd = cold_file
    reads = iter(range(1000))

    def shrinking() -> MemoryLimit:
        # Asked once at the start and once before each chunk: an engine allocates after the
        # third chunk.
        n = next(reads)
        return MemoryLimit("host memory (MemTotal)", 8 << 30, (4 << 30) if n < 4 else 512 * MiB)

    done = warm([Span(fd, 0, SIZE)], threading.Event(), shrinking, _calm)
    assert done.stopped.startswith("memory pressure: 512 MiB available"), done.stopped
    assert 3 * CHUNK_BYTES <= cached(path.parent) < SIZE / 2


def test_it_stops_when_what_it_read_is_evicted_again(
    cold_file: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, fd = cold_file
    read = pagewarm._read

    def read_then_lose(fd: int, offset: int, into: memoryview) -> int:
        # Memory pressure elsewhere: the kernel evicts each chunk as soon as it is read.
        got = read(fd, offset, into)
        os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
        return got

    monkeypatch.setattr(pagewarm, "_read", read_then_lose)
    done = warm([Span(fd, 0, SIZE)], threading.Event(), _plenty, _calm)
    assert done.stopped.startswith("the page cache evicts what was read (0 of 64 MiB"), done
    assert cached(path.parent) < SIZE / 20


def test_a_stop_ends_it_before_the_next_chunk(cold_file: tuple[Path, int]) -> None:
    path, fd = cold_file
    stop = threading.Event()
    stop.set()
    done = warm([Span(fd, 0, SIZE)], stop, _plenty, _calm)
    assert done.stopped == "the daemon is stopping" and cached(path.parent) < SIZE / 20


def test_it_stops_when_the_node_stalls_on_memory(cold_file: tuple[Path, int]) -> None:
    path, fd = cold_file
    done = warm([Span(fd, 0, SIZE)], threading.Event(), _plenty, lambda: 35.0)
    assert done.stopped == (
        "memory pressure: every task stalled on memory 35% of the last 10 s (PSI full)"
    )
    assert cached(path.parent) < SIZE / 20


def test_psi_is_read_where_the_kernel_has_it(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure/memory").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=100\n"
        "full avg10=1.00 avg60=0.00 avg300=0.00 total=10\n"
    )
    assert memory_stall_pct(str(tmp_path)) == 1.0
    assert memory_stall_pct(str(tmp_path / "none")) is None


def test_a_set_whose_file_is_gone_ends_its_warm_up_stopped_with_why(tmp_path: Path) -> None:
    # A disk set dropped (or cut) while its warm-up waited: the warm-up says so, no task fails.
    backing = DiskBacking(str(tmp_path), None, allow_disk=True, holder="test")
    tensor = ManifestTensor("t", "U8", (64,), "t.bin", 0, 64, "0")
    manifest = Manifest("0" * 20, "f", "n", "ckpt", "*", 0.0, (tensor,))
    ts = TableSet(
        set_id="0" * 20,
        checkpoint="ckpt",
        selection="*",
        fingerprint="f",
        nbytes=64,
        ntensors=1,
        backing=backing,
        state=SetState.READY,
        manifest=manifest,
    )
    asyncio.run(PageCacheWarmer(True).warm(ts))
    assert ts.warming.startswith("stopped: ") and "t.bin" in ts.warming, ts.warming
    off = TableSet(**{**vars(ts), "warming": ""})
    asyncio.run(PageCacheWarmer(False).warm(off))
    assert off.warming == "off"
