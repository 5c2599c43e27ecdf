"""The disk sets' page cache warmed once per node, one set at a time, after each is served.

A set on the disk backing is read by every engine through the node's page
cache. The daemon reads it in once, when it is ready or adopted (never before:
readiness and adoption do not wait), on one bounded daemon thread, within the
memory the node can spare and stopped under pressure (engramd.host.pagewarm).
Each warm-up logs one line when it starts and one when it ends; its state is
the set's `warming`, shown by status.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from engramd.host.blocking import BlockingPool
from engramd.sets.tableset import COMPLETE, TableSet
from engramd.units import gib
from engramd_shared.layout import ManifestError

log = logging.getLogger("engramd")

#: TableSet.warming: waiting behind another set's warm-up, reading, done, turned off.
WAITING = "waiting"
WARMING = "warming"
WARMED = "warmed"
OFF = "off"
#: The prefix of a warm-up that ended early; the reason follows.
STOPPED = "stopped: "


class PageCacheWarmer:
    """Warms the sets whose backing is the page cache's (`Backing.warmable`), one at a time."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        # One thread: two sets read at once would only share the disk.
        self._pool = BlockingPool("warm", 1)
        self._turn = asyncio.Lock()
        # Each warm-up's stop, by the set's identity (a set dropped and loaded again is another).
        self._stops: dict[int, threading.Event] = {}
        self._closing = False

    async def warm(self, ts: TableSet) -> None:
        """Read `ts` into the page cache once, where its backing is warmable; returns when done."""
        if ts.manifest is None or not ts.backing.warmable:
            return
        if not self._enabled:
            ts.warming = OFF
            return
        stop = self._stops.setdefault(id(ts), threading.Event())
        ts.warming = WAITING
        try:
            async with self._turn:
                if stop.is_set() or self._closing:
                    ts.warming = STOPPED + "the set was dropped, or the daemon is stopping"
                    return
                ts.warming = WARMING
                log.info(
                    "warming set %s into the page cache: %s (%s)",
                    ts.copy,
                    gib(ts.nbytes),
                    ts.backing.name,
                )
                done = await self._pool.run(ts.backing.warm, ts.manifest, stop)
        except (OSError, ManifestError) as e:
            # Dropped meanwhile, or a file cut short: the next attach finds it and says so.
            ts.warming = f"{STOPPED}{e}"
            log.warning("set %s warm-up stopped: %s", ts.copy, e)
            return
        finally:
            self._stops.pop(id(ts), None)
        ts.warming = STOPPED + done.stopped if done.stopped else WARMED
        log.info(
            "set %s %s: %s read in %.2f s (%.2f GB/s), %s of %s was cached already",
            ts.copy,
            f"warm-up stopped ({done.stopped})" if done.stopped else "warmed",
            gib(done.read),
            done.seconds,
            done.read / max(done.seconds, 1e-9) / 1e9,
            gib(done.skipped),
            gib(done.total),
        )

    def forget(self, ts: TableSet) -> None:
        """Stop warming `ts` (dropped): its reads end at the next chunk."""
        if (stop := self._stops.get(id(ts))) is not None:
            stop.set()

    def close(self) -> None:
        """Stop every warm-up at its next chunk, and start no other (the daemon stops)."""
        self._closing = True
        for stop in self._stops.values():
            stop.set()


def cached_bytes(ts: TableSet) -> int | None:
    """Bytes of a complete set in the page cache it is served from (a disk's), read without
    faulting a page in; None for a set held in memory whole, or one not complete."""
    if ts.manifest is None or ts.state not in COMPLETE:
        return None
    try:
        return ts.backing.resident(ts.manifest)
    except (OSError, ManifestError):
        return None  # dropped meanwhile, or a file cut short (the next attach says so)
