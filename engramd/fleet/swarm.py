"""Which source reads which piece of a set: a fill's schedule across the fleet.

A set is filled in pieces (strong.PIECE_BYTES each, every one verifiable on
its own against the attested digests), from every source that holds some:
peers, the object store, and last the node's own files. The schedule only
decides; whatever moves the bytes asks it what to start and tells it what
ended: the daemon's fills from peers (swarmfill.py) and the fleet
simulation (tests/support/fleetsim.py), so what is simulated is what runs.

The rules, chosen as BitTorrent's and Dragonfly's are, for a fleet where one
warm node and a bucket face hundreds of cold ones:

- **Slots**: each source has a depth (requests in flight to it at once), and
  the receiver a width (requests in flight in all). A free slot is filled at
  once, so every source works at its depth while it has pieces to give.
- **Which source, and how many requests each**: a source not measured yet
  gets one request (a probe); a measured one keeps its share of the width
  in flight, in proportion to its rate on its recent pieces (an
  exponentially weighted mean of bytes over seconds), at least one and at
  most its depth. Free slots go to the fastest first. A source that answers
  slowly (its link shared by many, its `--peer-rate`) thus carries less of
  the fill without being dropped, and a fast one more, and a slow source
  never holds the whole width. Ties go by rendezvous hashing of receiver and
  source, so equal peers split a fleet's receivers between them instead of
  every receiver picking the same first one.
- **Peers that hold some before peers that hold all**: a free slot goes
  to a filling peer that holds a needed piece before a peer that holds the
  whole set (the warm node, or one done filling): the whole-set holders'
  links are what a cold fleet is short of, so they are asked for what no
  one else can give, and each piece leaves them about once.
- **Which piece**: the rarest first, counted over the peers that are
  known to hold it (a piece only the warm node has is fetched before one
  many hold, so new holders multiply the scarce pieces); ties by rendezvous
  hashing of receiver and piece, so receivers asking one source at once
  ask it for different pieces.
- **Tiers**: the node's own files are a source only of pieces no other
  source holds (a cold node reads its disk only when no peer and no bucket
  can give a piece). The object store holds every piece, like a warm peer,
  and competes by its rate.
- **The end**: once every needed piece is requested, a free slot asks a
  source at least twice as fast for a piece whose only request is at a
  slower one (BitTorrent's end game); the first to land wins and the other
  request is moot (`landed` names it, to cancel). One slow source thus
  never holds up the fill's last piece.
- **Busy**: a source with no free slot of its own (a serving node's
  requests at once, the bucket's) says so at once rather than queueing the
  request. Where it is serving others of this receiver's requests, it is
  asked for no more at once than that (`full`), one more again after each
  piece that lands. Otherwise the piece goes back to the pool and the source
  is not asked again for about one request's time (the receiver's recent mean), or,
  while it keeps answering busy, for twice as long each time from
  `BUSY_RETRY_S` up to `MAX_REST_S` (jittered by receiver, so a fleet's
  retries do not arrive together). A receiver's requests are thus never
  parked behind other receivers' at one source while others idle, and a
  thousand cold nodes do not ask a full bucket a thousand times a second.
- **Failures**: a request that fails returns its piece to the pool; a
  source that fails `MAX_FAILURES` requests in a row, or that sent one piece
  whose digest is not the attested one, is dropped for the rest of the fill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import xxhash

#: Failed requests in a row after which a source is dropped.
MAX_FAILURES = 3
#: Weight of the newest piece in a source's measured rate.
RATE_WEIGHT = 0.3
#: Seconds a source that answered busy is left alone, at least.
BUSY_RETRY_S = 0.01
#: Seconds a source that keeps answering busy is left alone, at most.
MAX_REST_S = 2.0


class Tier(IntEnum):
    """What kind of source: peers and the object store compete; files are the last resort."""

    PEER = 0
    STORE = 1
    FILES = 2


@dataclass
class Source:
    """One source of pieces as the schedule sees it."""

    name: str
    tier: Tier
    #: Requests in flight to it at once, at most.
    depth: int
    #: The pieces it holds (every piece for the store and the files).
    held: set[int]
    #: Pieces requested from it and not yet ended.
    in_flight: set[int] = field(default_factory=set)
    #: Bytes a second of its recent pieces (0.0: not measured yet).
    rate: float = 0.0
    #: Bytes it delivered that verified.
    delivered: int = 0
    #: Requests that failed in a row.
    failures: int = 0
    #: Not asked before this time (it answered busy).
    resting_until: float = 0.0
    #: Busy answers in a row.
    busy: int = 0
    #: Requests it took at once when it last had no free slot for one more of ours (0: none
    #: seen): its slots are shared with other receivers, and this is our part of them now.
    took: int = 0
    #: Its rendezvous score for this receiver: the tie-break between equal sources.
    tie: int = 0
    #: Why it was dropped ("": it was not).
    dropped: str = ""


def _score(*parts: str | int) -> int:
    return xxhash.xxh3_64_intdigest("\0".join(str(p) for p in parts).encode())


class Schedule:
    """The pieces of one fill and who reads each: `start` says what to request next,
    `landed`/`failed` what ended. Not thread-safe: one caller drives it."""

    def __init__(self, sizes: list[int], receiver: str, width: int) -> None:
        #: Each piece's bytes.
        self.sizes = sizes
        self._receiver = receiver
        self._width = width
        self._needed = set(range(len(sizes)))
        # Needed pieces no request is out for: what `start` chooses from.
        self._free = set(self._needed)
        # The sources each requested piece is asked of (two at most, at the end).
        self._in_flight: dict[int, set[str]] = {}
        self._requests = 0
        self.sources: dict[str, Source] = {}
        # Peers known to hold each piece: the rarity the piece order follows.
        self._holders = [0] * len(sizes)
        self._tie = [_score(receiver, p) for p in range(len(sizes))]
        # Seconds of a recent request, any source's: how long a busy source rests.
        self._typical = 0.0

    # -- what the sources hold ------------------------------------------------

    def add(self, name: str, tier: Tier, depth: int, held: Iterable[int] | None = None) -> None:
        """A source; `held` None: it holds every piece (the store and the files always do)."""
        if tier is not Tier.PEER and held is not None:
            raise ValueError(f"{name}: the store and the files hold every piece")
        pieces = set(range(len(self.sizes))) if held is None else set(held)
        self.sources[name] = Source(name, tier, depth, pieces, tie=_score(self._receiver, name))
        if tier is Tier.PEER:
            for p in pieces:
                self._holders[p] += 1

    def holds(self, name: str, pieces: Iterable[int]) -> bool:
        """Source `name` now holds `pieces` too (a filling peer verified them); whether one of
        them is still needed here (`start` may then have more to start)."""
        source = self.sources[name]
        wanted = False
        for p in pieces:
            if p not in source.held:
                source.held.add(p)
                if source.tier is Tier.PEER and not source.dropped:
                    self._holders[p] += 1
            wanted = wanted or p in self._needed
        return wanted

    # -- what to do next ------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether every piece landed."""
        return not self._needed

    def stuck(self) -> bool:
        """Whether pieces are needed that no source still in the fill can give."""
        if not self._needed:
            return False
        live = [s for s in self.sources.values() if not s.dropped]
        return any(all(p not in s.held for s in live) for p in self._needed)

    def start(self, now: float) -> list[tuple[int, str]]:
        """The (piece, source) requests to start at time `now`: one per free slot."""
        started: list[tuple[int, str]] = []
        while self._requests < self._width:
            pick = self._next(now)
            if pick is None:
                break
            piece, source = pick
            self._in_flight.setdefault(piece, set()).add(source.name)
            self._free.discard(piece)
            self._requests += 1
            source.in_flight.add(piece)
            started.append((piece, source.name))
        return started

    def wake(self) -> float | None:
        """When a resting source may be asked again, if pieces wait for one (None: none do)."""
        if self._requests >= self._width or len(self._in_flight) == len(self._needed):
            return None
        resting = [s.resting_until for s in self.sources.values() if not s.dropped]
        return min(resting) if resting else None

    def _next(self, now: float) -> tuple[int, Source] | None:
        free = self._free
        live = [s for s in self.sources.values() if not s.dropped]
        total = sum(s.rate for s in live)
        ready = [
            s for s in live if s.resting_until <= now and len(s.in_flight) < self._share(s, total)
        ]
        # Files last, and peers that hold every piece after those that hold some; then
        # unmeasured sources, then the fastest; ties by rendezvous.
        everything = len(self.sizes)
        ready.sort(
            key=lambda s: (
                s.tier is Tier.FILES,
                s.tier is Tier.PEER and len(s.held) == everything,
                s.rate != 0.0,
                -s.rate,
                -s.tie,
            )
        )
        for source in ready:
            if source.tier is Tier.FILES:
                # The store holds every piece; without one, what no live peer holds.
                if any(o.tier is Tier.STORE for o in live):
                    continue
                mine = {p for p in free if not self._holders[p]}
            else:
                mine = free & source.held
            if mine:
                return min(mine, key=lambda p: (self._holders[p], -self._tie[p])), source
            if not free and source.rate:
                late = self._late(source)
                if late is not None:
                    return late, source
        return None

    def _late(self, source: Source) -> int | None:
        """The end game: a piece `source` holds whose one request is at a source less than
        half as fast (or not measured), the slowest such first."""
        best: tuple[float, int] | None = None
        for p, names in self._in_flight.items():
            if len(names) > 1 or source.name in names or p not in source.held:
                continue
            (other,) = names
            rate = self.sources[other].rate
            if rate * 2 <= source.rate and (best is None or rate < best[0]):
                best = (rate, p)
        return None if best is None else best[1]

    def _share(self, source: Source, total: float) -> int:
        """Requests `source` may have in flight: one until measured, then its rate's part
        of the width (`total`: the live sources' rates), 1 to its depth."""
        if source.rate == 0.0:
            return 1
        depth = min(source.depth, source.took) if source.took else source.depth
        return max(1, min(depth, round(self._width * source.rate / total)))

    # -- what ended -----------------------------------------------------------

    def landed(self, piece: int, name: str, seconds: float) -> list[str]:
        """The piece arrived from `name` in `seconds` and its digest is the attested one; the
        sources whose requests for it are now moot (to cancel)."""
        source = self.sources[name]
        moot = self._in_flight.get(piece, set()) - {name}
        if self._end(piece, name) is None:
            return []  # a request already moot: its piece came from another source
        for other in moot:
            self._end(piece, other)
        source.failures = source.busy = 0
        if source.took:
            # Ask for one more at once again: the others' part of its slots may have ended.
            source.took = min(source.depth, source.took + 1)
        source.delivered += self.sizes[piece]
        rate = self.sizes[piece] / max(seconds, 1e-9)
        self._typical = (
            seconds
            if self._typical == 0.0
            else (RATE_WEIGHT * seconds + (1 - RATE_WEIGHT) * self._typical)
        )
        source.rate = (
            rate if source.rate == 0.0 else (RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * source.rate)
        )
        self._needed.discard(piece)
        self._free.discard(piece)
        return sorted(moot)

    def busy(self, piece: int, name: str, now: float) -> None:
        """`name` had no free slot for the request: the piece goes back, the source rests."""
        source = self._end(piece, name)
        if source is None:
            return
        source.busy += 1
        backoff = min(MAX_REST_S, BUSY_RETRY_S * 2 ** (source.busy - 1))
        jitter = 0.5 + _score(self._receiver, name, source.busy) / 2**64
        source.resting_until = now + max(self._typical, backoff * jitter)

    def full(self, piece: int, name: str) -> None:
        """`name` had no free slot for the request but is serving others of ours: the piece
        goes back, and the source is asked for no more at once than it is serving now (no
        rest: a slot frees when one of ours lands)."""
        source = self._end(piece, name)
        if source is not None:
            source.took = max(1, len(source.in_flight))

    def failed(self, piece: int, name: str, why: str, lied: bool = False) -> None:
        """The request ended without the piece; `lied`: bytes came with another digest, so
        the source is dropped at once."""
        if self._end(piece, name) is None:
            return
        source = self.sources[name]
        source.failures += 1
        if lied or source.failures >= MAX_FAILURES:
            self.drop(name, why)

    def cancel(self, piece: int, name: str) -> None:
        """End the request of `piece` from `name` without counting it (its piece is coming
        from another source)."""
        self._end(piece, name)

    def drop(self, name: str, why: str) -> None:
        """Use `name` no more in this fill (it died, lied or failed too often); its pieces in
        flight are asked of others once they end."""
        source = self.sources[name]
        if source.dropped:
            return
        source.dropped = why
        if source.tier is Tier.PEER:
            for p in source.held:
                self._holders[p] -= 1

    def _end(self, piece: int, name: str) -> Source | None:
        """End the request of `piece` from `name`; None if none is live (it was moot)."""
        names = self._in_flight.get(piece)
        if names is None or name not in names:
            return None
        names.discard(name)
        if not names:
            del self._in_flight[piece]
            if piece in self._needed:
                self._free.add(piece)
        self._requests -= 1
        source = self.sources[name]
        source.in_flight.discard(piece)
        return source
