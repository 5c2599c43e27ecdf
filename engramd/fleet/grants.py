"""What the peer service grants at most: bytes a second (--peer-rate), pieces at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

#: Pieces granted and not yet read, over all streams, beyond which a request is answered busy:
#: a receiver then asks another source at once rather than queueing behind other receivers
#: here (a warm node facing a cold fleet would otherwise send most of every copy itself).
SERVE_SLOTS = 2
#: Seconds a granted piece holds its serving slot at most: a receiver that neither reads it nor
#: says `done` (gone, or hostile) does not keep the node busy for everyone else.
GRANT_HOLD_S = 10.0


class RateCap:
    """Grants bytes at most at `rate` per second, all streams together (0: at once).

    Each grant books its bytes' time on one clock; a window waits until the
    clock reaches its booking. A window is at most WINDOW_BYTES (the caller
    bounds it), so no one booking holds the clock for more than
    WINDOW_BYTES / rate, and a booking whose stream ended before its grant
    went out gives its time back.
    """

    def __init__(self, rate: int) -> None:
        self._rate = rate
        self._free_at = 0.0

    async def take(self, n: int) -> None:
        """Wait until `n` more bytes may go; cancelled, it books nothing."""
        if not self._rate:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._free_at)
        cost = n / self._rate
        self._free_at = start + cost
        if start <= now:
            return
        try:
            await asyncio.sleep(start - now)
        except asyncio.CancelledError:
            # Never granted: the streams booking after it start that much sooner.
            self._free_at -= cost
            raise


class Slots:
    """The serving slots: pieces granted and not yet read, over all streams, beyond which a
    request is answered busy (SERVE_SLOTS)."""

    def __init__(self) -> None:
        #: Each stream's pieces granted and not yet read, with when each was granted.
        self._granted: dict[int, dict[int, float]] = {}

    @contextlib.contextmanager
    def stream(self) -> Iterator[dict[int, float]]:
        """The pieces granted on one stream and not yet read (piece: when granted), counted
        while the stream lasts: their slots free when it ends."""
        outstanding: dict[int, float] = {}
        self._granted[id(outstanding)] = outstanding
        try:
            yield outstanding
        finally:
            del self._granted[id(outstanding)]

    def busy(self) -> bool:
        """Whether every serving slot holds a piece granted less than GRANT_HOLD_S ago."""
        since = asyncio.get_running_loop().time() - GRANT_HOLD_S
        held = sum(1 for grants in self._granted.values() for t in grants.values() if t > since)
        return held >= SERVE_SLOTS
