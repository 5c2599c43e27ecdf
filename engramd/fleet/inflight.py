"""Reads in flight, completed in order, `depth` at most: the next reads are on the wire while
the oldest completes, and each completed read's `then` runs (its window moves out of the
landing ring: landing.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engramd.fleet.base import SourceFailed
from engramd.fleet.nixlxfer import Agent, TransferFailed
from engramd.sets.seams import FillProgress


class InOrder:
    """Posted reads, `depth` at most, completed in the order they were posted."""

    def __init__(
        self,
        agent: Agent,
        progress: FillProgress,
        depth: int,
        what: str,
    ) -> None:
        self._agent = agent
        self._progress = progress
        self._depth = depth
        self._what = what
        self._in_flight: deque[tuple[int, int, float, Callable[[], None]]] = deque()

    def add(self, handle: int, nbytes: int, deadline: float, then: Callable[[], None]) -> None:
        """A posted read of `nbytes`, and what to do once it completed; completes the oldest
        reads that are done, and the oldest in any case once `depth` are in flight."""
        self._in_flight.append((handle, nbytes, deadline, then))
        while self._in_flight and (len(self._in_flight) >= self._depth or self._oldest_done()):
            self._complete()

    def _oldest_done(self) -> bool:
        try:
            return self._agent.done(self._in_flight[0][0])
        except TransferFailed as e:
            raise SourceFailed(f"the read from {self._what} failed: {e}") from None

    def finish(self) -> None:
        """Complete every read."""
        while self._in_flight:
            self._complete()

    def _complete(self) -> None:
        handle, nbytes, deadline, then = self._in_flight.popleft()
        try:
            self._agent.wait(handle, deadline, self._progress.cancel)
        except TransferFailed as e:
            raise SourceFailed(f"the read from {self._what} failed: {e}") from None
        then()
        self._progress.add(nbytes)
