"""Where a fill's transfer process puts the bytes it reads: a ring of slots of its own, which
the daemon moves into the staged set, digesting each window as it moves it.

The transfer process maps the ring and nothing of the set: over TCP its UCX
port serves writes at any address of that process to whoever connects, so
the ring is all that anyone can write into. The daemon copies each landed
window out of its slot into the staged set (write(2) into the set's file,
which the transfer process never maps) and digests the copy there, each MiB
as soon as it is written (MOVE_CHUNK), so the digests are of exactly the
bytes that will be published, taken while the next windows are on the wire,
on every core. A window is one piece of the strong digest
(strong.PIECE_BYTES), so windows move and digest in any order. A slot is
reused once its window has moved. A fill that reads with two
transfer processes (the peers', and the object store's, which holds the
store's keys and so never listens: objstore.py) gives each a ring of its
own (`add_ring`); the moves and digests are shared.

    ring (memfd, slots x PIECE_BYTES)          staged set (the daemon's)
    [ slot 0 | slot 1 | ... | slot n-1 ]  -->  tensor i, piece k
       ^ the transfer process reads here          ^ written, then digested
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from engramd.backings.regions import Region
from engramd.fleet.nixlxfer import Agent
from engramd.strong import (
    PIECE_BYTES,
    piece_hasher,
    pieces,
    tensor_digest,
    threads,
)

#: Threads that move and digest windows at most (a core each, at about 3 GB/s with BLAKE3).
MAX_MOVERS = 32
#: The bytes of a window written, then digested, at a time: the digest reads what was just
#: written while it is in the core's cache (2 MiB of L2 on this EPYC) rather than the whole
#: piece back from memory afterwards (one core, into a reserved tmpfs file: 0.37 against 0.43
#: CPU-s a GiB).
MOVE_CHUNK = 1 << 20


def movers() -> int:
    """Threads that move and digest windows: half the cores (the transfer processes' polling
    and the kernel's copies take the others: on 2 cores a second mover made fills slower)."""
    return max(1, min(threads() // 2, MAX_MOVERS))


class _Ring:
    """Slots of one piece each in a file both the daemon and one transfer process map."""

    def __init__(self, agent: Agent, in_flight: int) -> None:
        # Two windows a mover keep it busy while the next ones land.
        slots = in_flight + 2 * movers()
        fd = os.memfd_create("engramd-landing", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * PIECE_BYTES)
            #: The ring as the daemon maps it.
            self.region = Region(fd, 0, slots * PIECE_BYTES, populate=True)
            try:
                #: Its address in the transfer process.
                (self.there,) = agent.attach([(fd, 0, slots * PIECE_BYTES)], writable=True)
            except BaseException:
                self.region.close()
                raise
        finally:
            os.close(fd)
        self.free = deque(range(slots))


class Landing:
    """Rings of slots of one piece each, the first mapped by `agent`'s transfer process,
    and by the daemon, for fills of the staged `regions` (mapped read-only in the daemon, to
    digest them) with at most `in_flight` windows on the wire at once."""

    def __init__(self, agent: Agent, regions: list[Region], in_flight: int) -> None:
        #: The staged set's tensors.
        self.regions = regions
        self._pieces = [[b""] * len(pieces(r.nbytes)) for r in regions]
        self._expected: list[list[bytes]] | None = None
        self._rings = [_Ring(agent, in_flight)]
        self._moves: deque[Future[None]] = deque()
        self._movers = ThreadPoolExecutor(movers(), "engramd-landing")
        #: Tensors written through a writable mapping of the daemon's (hugetlbfs).
        self._mapped: dict[int, Region] = {}
        self._mapping = threading.Lock()

    def expect(self, piece_digests: list[list[bytes]]) -> None:
        """Compare each piece with its digest in `piece_digests` (each tensor's, checked
        against its attested strong digest) as it moves; one that differs is not counted
        (`landed` says so). Before the first window lands."""
        self._expected = piece_digests

    def add_ring(self, agent: Agent, in_flight: int) -> int:
        """A ring of its own for another transfer process's reads, `in_flight` at once; its
        number, for `slot`, `landed` and `discard`."""
        self._rings.append(_Ring(agent, in_flight))
        return len(self._rings) - 1

    def retire(self, ring: int = 0) -> None:
        """Unmap ring `ring`, whose transfer process ended, once the moves under way (which
        read it) are done; windows that had not landed there are gone, the pieces verified
        kept."""
        while self._moves:
            self._moves.popleft().result()
        self._rings[ring].region.close()

    def renew(self, agent: Agent, in_flight: int, ring: int = 0) -> None:
        """Ring `ring` anew in `agent`, the transfer process that takes the place of one that
        ended (the old ring retired first)."""
        self.retire(ring)
        self._rings[ring] = _Ring(agent, in_flight)

    def slot(self, ring: int = 0) -> tuple[int, int]:
        """A free slot of `ring` and its address in that ring's transfer process; waits for
        the oldest move when every slot holds a window (raises what a move raised)."""
        free = self._rings[ring].free
        while not free:
            if not self._moves:
                raise RuntimeError("every slot of the landing ring is in flight")
            self._moves.popleft().result()
        slot = free.popleft()
        return slot, self._rings[ring].there + slot * PIECE_BYTES

    def landed(
        self,
        slot: int,
        index: int,
        at: int,
        then: Callable[[bool], None] | None = None,
        ring: int = 0,
    ) -> None:
        """The window in `slot` of `ring` arrived: it is the piece of tensor `index` at `at`.
        Once it moved, `then` is told (on a mover's thread) whether it has the expected
        digest."""
        while self._moves and self._moves[0].done():
            self._moves.popleft().result()
        self._moves.append(
            self._movers.submit(self._move, self._rings[ring], slot, index, at, then)
        )

    def discard(self, slot: int, ring: int = 0) -> None:
        """The window in `slot` of `ring` is not wanted (its piece came from elsewhere): free
        the slot."""
        self._rings[ring].free.append(slot)

    def put(self, index: int, at: int, data: bytearray, then: Callable[[bool], None]) -> None:
        """The piece of tensor `index` at `at`, read elsewhere (the node's own files) into
        `data`: moved and compared as a landed window is."""
        while self._moves and self._moves[0].done():
            self._moves.popleft().result()
        self._moves.append(self._movers.submit(self._put, index, at, data, then))

    def _move(
        self, ring: _Ring, slot: int, index: int, at: int, then: Callable[[bool], None] | None
    ) -> None:
        nbytes = self._piece_bytes(index, at)
        start = slot * PIECE_BYTES
        try:
            window = ring.region.view()[start : start + nbytes]
            found = self._write(index, at, window, ring.region.address + start)
        finally:
            ring.free.append(slot)
        self._check(index, at, found, then)

    def _put(self, index: int, at: int, data: bytearray, then: Callable[[bool], None]) -> None:
        nbytes = self._piece_bytes(index, at)
        if len(data) != nbytes:
            raise ValueError(f"{len(data)} bytes for a piece of {nbytes}")
        held = (ctypes.c_char * nbytes).from_buffer(data)
        found = self._write(index, at, memoryview(data), ctypes.addressof(held))
        self._check(index, at, found, then)

    def _piece_bytes(self, index: int, at: int) -> int:
        region = self.regions[index]
        if at % PIECE_BYTES or not 0 <= at < region.nbytes:
            raise ValueError(f"no piece of tensor {index} starts at {at}")
        return min(PIECE_BYTES, region.nbytes - at)

    def _check(
        self, index: int, at: int, found: bytes, then: Callable[[bool], None] | None
    ) -> None:
        good = self._expected is None or self._expected[index][at // PIECE_BYTES] == found
        if good:
            self._pieces[index][at // PIECE_BYTES] = found
        if then is not None:
            then(good)

    def _write(self, index: int, at: int, window: memoryview, address: int) -> bytes:
        """`window` (at `address` in this process) to bytes `at`.. of tensor `index`, and
        the piece digest of what the set holds there afterwards."""
        written = self.regions[index].view()[at : at + len(window)]
        hasher = piece_hasher()
        for start in range(0, len(window), MOVE_CHUNK):
            end = min(start + MOVE_CHUNK, len(window))
            self._write_part(index, at + start, window[start:end], address + start)
            hasher.update(written[start:end])
        return hasher.digest()

    def _write_part(self, index: int, at: int, window: memoryview, address: int) -> None:
        """`window` (at `address` in this process) to bytes `at`.. of tensor `index`: by
        write(2), not by stores through a writable mapping, which would cost an unmap of
        pages the daemon dirtied (~0.2 s a GiB of 4 KiB pages) before a memfd set may be
        sealed."""
        region = self.regions[index]
        nbytes = len(window)
        if index not in self._mapped:
            try:
                done = 0
                while done < nbytes:
                    done += os.pwrite(region.fd, window[done:], region.offset + at + done)
                return
            except OSError as e:
                # hugetlbfs takes no write(2); its pages are huge, its mappings cheap.
                if e.errno != errno.EINVAL:
                    raise
            with self._mapping:
                if index not in self._mapped:
                    self._mapped[index] = Region(region.fd, region.offset, region.nbytes, True)
        ctypes.memmove(self._mapped[index].address + at, address, nbytes)

    def digests(self) -> list[str]:
        """Each tensor's strong digest, once every landed window has moved; raises ValueError
        naming a tensor with a piece that never landed."""
        while self._moves:
            self._moves.popleft().result()
        for index, found in enumerate(self._pieces):
            if b"" in found:
                raise ValueError(f"piece {found.index(b'')} of tensor {index} never landed")
        return [tensor_digest(found) for found in self._pieces]

    def close(self) -> None:
        """Stop moving (windows not moved yet are dropped) and unmap the rings."""
        self._movers.shutdown(wait=True, cancel_futures=True)
        for ring in self._rings:
            ring.region.close()
        for region in self._mapped.values():
            region.close()
        self._mapped.clear()

    def __enter__(self) -> Landing:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
