"""Reads in flight, completed in order: each window is digested into its tensor's digest as
it lands, while the next reads are on the wire (a second pass over the set would cost as
much as a tenth of its transfer here)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engramd.checksum import label, new_digest
from engramd.sources.base import Progress, SourceFailed
from engramd.sources.nixlxfer import Agent, TransferFailed
from engramd.sources.regions import Region

#: (tensor index, offset in the tensor, bytes) of one window.
Window = tuple[int, int, int]


class InOrder:
    """Posted reads, `depth` at most, completed and digested in the order they were posted."""

    def __init__(
        self,
        agent: Agent,
        regions: list[Region],
        progress: Progress,
        depth: int,
        what: str,
        landed: Callable[[int], None] | None = None,
    ) -> None:
        self._agent = agent
        self._regions = regions
        self._progress = progress
        self._depth = depth
        self._what = what
        self._landed = landed
        self._digests = [new_digest() for _ in regions]
        self._in_flight: deque[tuple[list[Window], Any, float]] = deque()

    def add(self, handle: Any, windows: list[Window], deadline: float) -> None:
        """A posted read of `windows`; completes the oldest reads that are done, and the
        oldest in any case once `depth` are in flight."""
        self._in_flight.append((windows, handle, deadline))
        while self._in_flight and (len(self._in_flight) >= self._depth or self._oldest_done()):
            self._complete()

    def _oldest_done(self) -> bool:
        try:
            return self._agent.done(self._in_flight[0][1])
        except TransferFailed as e:
            raise SourceFailed(f"the read from {self._what} failed: {e}") from None

    def finish(self) -> list[str]:
        """Complete every read; each tensor's digest (the manifest's format)."""
        while self._in_flight:
            self._complete()
        return [label(d) for d in self._digests]

    def abandon(self) -> None:
        """After a failure: wait out what is still in flight (briefly), so that no read
        writes into memory the loader is about to discard."""
        while self._in_flight:
            _, handle, _ = self._in_flight.popleft()
            with contextlib.suppress(TransferFailed):
                self._agent.wait(handle, time.monotonic() + 5, threading.Event())

    def _complete(self) -> None:
        windows, handle, deadline = self._in_flight.popleft()
        try:
            self._agent.wait(handle, deadline, self._progress.cancel)
        except TransferFailed as e:
            raise SourceFailed(f"the read from {self._what} failed: {e}") from None
        for index, at, n in windows:
            self._digests[index].update(self._regions[index].view()[at : at + n])
            self._progress.add(n)
            if self._landed is not None:
                self._landed(n)
