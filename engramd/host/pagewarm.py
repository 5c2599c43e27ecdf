"""Files read into the page cache ahead of their readers, within the memory the node can spare.

A disk-backed set is read by every worker on the node through one page
cache; the first reads of a cold set wait on the disk. Warming reads the
set's bytes once, on one daemon thread, so the engines that start later find
them cached. It never takes memory the node needs:

- the bytes it may bring in are bounded when it starts: what the host and the
  daemon's memory cgroup have available (engramd.host.memlimit) less a
  headroom (HEADROOM_BYTES, at most an eighth of the bound);
- it stops as soon as memory is short: the available memory falls under the
  headroom (an engine allocating, or the cgroup's limit filling with the
  pages read: v1 counts them), the kernel reports the node stalled on memory
  (PSI, /proc/pressure/memory "full avg10" over PRESSURE_PCT: every runnable
  task waiting on memory at once; "some" also counts a container thrashing
  against its own limit, which the warm-up does not relieve), or the pages it
  read are being evicted again (the cache cannot hold them: warming further
  would only churn the disk);
- bytes already cached are skipped without a read (cachestat or mincore).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engramd.host.memlimit import MemoryLimit, memory_limit
from engramd.host.pagecache import resident_bytes

#: Memory left to the node when warming: engines allocate after the daemon warms.
HEADROOM_BYTES = 1 << 30
#: Bytes read at once: large enough for the disk's largest requests, small enough to check
#: memory often.
CHUNK_BYTES = 8 << 20
#: Share of the last 10 s in which every runnable task stalled on memory (PSI "full") that
#: stops warming.
PRESSURE_PCT = 10.0
#: Bytes read between checks that what was read is still cached.
EVICTION_CHECK_BYTES = 64 << 20
#: Share of the bytes read that must still be cached at a check.
KEPT_SHARE = 0.9


@dataclass(frozen=True)
class Span:
    """A range of an open file to warm."""

    fd: int
    offset: int
    length: int


@dataclass(frozen=True)
class Warmed:
    """What a warm-up did."""

    #: Bytes of the spans the page cache gained (read, and the kernel's readahead).
    read: int
    #: Bytes of the spans cached when it started.
    skipped: int
    #: Bytes of the spans in all.
    total: int
    seconds: float
    #: Why it stopped before the end ("" when every byte is cached).
    stopped: str


def headroom(bound: MemoryLimit) -> int:
    """The memory warming leaves free: HEADROOM_BYTES, at most an eighth of the bound."""
    return min(HEADROOM_BYTES, bound.total // 8)


def memory_stall_pct(proc: str = "/proc") -> float | None:
    """PSI's "full avg10" for memory (percent of the last 10 s); None without PSI."""
    try:
        text = (Path(proc) / "pressure/memory").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("full "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "avg10":
                    return float(value)
    return None


def warm(
    spans: list[Span],
    stop: threading.Event,
    limit: Callable[[], MemoryLimit] = memory_limit,
    stall: Callable[[], float | None] = memory_stall_pct,
) -> Warmed:
    """Read `spans` into the page cache, chunk by chunk, until done, `stop` is set, or memory
    is short (the module's rules); what was read stays cached for the kernel to evict."""
    started = time.monotonic()
    total = sum(s.length for s in spans)
    before = _cached(spans)
    bound = limit()
    spare = headroom(bound)
    budget = bound.available - spare
    read = unchecked = 0
    kept: list[Span] = []  # the ranges read since the last check that they stayed cached
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)

    def result(stopped: str) -> Warmed:
        gained = max(_cached(spans) - before, 0)
        return Warmed(gained, before, total, time.monotonic() - started, stopped)

    for span in spans:
        end = span.offset + span.length
        for at in range(span.offset, end, CHUNK_BYTES):
            size = min(CHUNK_BYTES, end - at)
            if stop.is_set():
                return result("the daemon is stopping")
            if resident_bytes(span.fd, at, size) >= size:
                continue  # cached, or read ahead by the kernel after the last chunk
            if read + size > budget:
                return result(
                    f"memory bound: {budget >> 20} MiB may be read ({bound.where}: "
                    f"{bound.available >> 20} MiB available, {spare >> 20} MiB kept free)"
                )
            if (why := _short_of_memory(limit, stall, spare)) is not None:
                return result(why)
            got = _read(span.fd, at, view[:size])
            read += got
            unchecked += got
            kept.append(Span(span.fd, at, got))
            if unchecked >= EVICTION_CHECK_BYTES:
                still = _cached(kept)
                if still < unchecked * KEPT_SHARE:
                    return result(
                        f"the page cache evicts what was read ({still >> 20} of "
                        f"{unchecked >> 20} MiB stayed)"
                    )
                kept.clear()
                unchecked = 0
            if got < size:
                break  # the file ends early: the set's checks say so at the next attach
    return result("")


def _cached(spans: list[Span]) -> int:
    return sum(resident_bytes(s.fd, s.offset, s.length) for s in spans)


def _short_of_memory(
    limit: Callable[[], MemoryLimit], stall: Callable[[], float | None], spare: int
) -> str | None:
    """Why memory is too short to read on, or None."""
    now = limit()
    if now.available < spare:
        return (
            f"memory pressure: {now.available >> 20} MiB available ({now.where}), "
            f"under the {spare >> 20} MiB kept free"
        )
    stalled = stall()
    if stalled is not None and stalled > PRESSURE_PCT:
        return (
            f"memory pressure: every task stalled on memory {stalled:.0f}% of the last 10 s "
            "(PSI full)"
        )
    return None


def _read(fd: int, offset: int, into: memoryview) -> int:
    """Bytes read at `offset` into `into`, until it is full or the file ends."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
