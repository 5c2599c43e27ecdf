"""A fleet filling one set, by discrete events, each node's fill decided by the daemon's own
schedule (engramd/fleet/swarm.py).

The model, kept simple and stated so its figures can be judged:

- One warm node holds the set; `nodes` cold nodes start filling together.
  Each cold node knows `peers` others (the warm one among them only if
  rendezvous hashing of set, node and peer ranks it there, as
  `peer.spread` orders a daemon's `--peers`) and the object store; its
  own files are a source only of pieces no one else holds.
- Every link carries `link` bytes a second each way. A node serves
  `serve_slots` requests at once, each at `link / serve_slots`, and answers
  any more "busy" (swarm.py); a receiver keeps `width` requests in flight,
  each at most `link / width`; a request moves at the lower of the two,
  fixed when it starts. The store serves `store_slots` at once, each at
  `store_rate / store_slots`.
- A piece is served by a filling node as soon as it landed (and, in the
  daemon, verified); every node that knows it learns that at once.
- Nothing is lost, no node lies or dies, the CPU is never the limit.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import xxhash

from engramd.fleet.swarm import Schedule, Tier

WARM = "warm"
STORE = "store"
FILES = "files"


@dataclass(frozen=True)
class Fleet:
    """What is simulated."""

    #: Cold nodes, started together.
    nodes: int
    #: Bytes a second of each node's link, each way.
    link: float
    #: Bytes a second the object store serves in all (0: no store).
    store_rate: float
    #: Bytes of the set.
    set_bytes: int
    #: Pieces the set is cut into: the daemon's are 16 MiB (strong.PIECE_BYTES), 12,096 for
    #: 189 GiB, which a simulation of 10,000 nodes cannot afford; coarser pieces only make
    #: each hop of a piece through the fleet longer (a piece is served once it landed whole).
    pieces: int = 256
    #: Peers each cold node knows.
    peers: int = 8
    #: Requests a node serves at once.
    serve_slots: int = 8
    #: Requests a receiver keeps in flight in all.
    width: int = 8
    #: Requests a receiver keeps in flight to one source, at most (its share follows its rate).
    depth: int = 8
    #: Requests the object store serves at once.
    store_slots: int = 256


@dataclass
class Outcome:
    """What a simulated fill came to."""

    #: Seconds until each cold node held every piece.
    ready: list[float]
    #: Bytes served by each source kind: "warm", "peers", "store", "files".
    served: dict[str, int] = field(default_factory=dict)

    @property
    def fleet_seconds(self) -> float:
        """Seconds until the last cold node was ready."""
        return max(self.ready)


class _Server:
    """A node's (or the store's) uplink: its free slots."""

    def __init__(self, source: int | str, slots: int, rate: float) -> None:
        #: The node (-1: the warm one) or STORE.
        self.source = source
        self.free = slots
        self.rate = rate


def _known_peers(fleet: Fleet, me: int) -> list[int]:
    """The `fleet.peers` others node `me` ranks first (-1: the warm node)."""
    everyone = [-1, *range(fleet.nodes)]
    score = lambda p: xxhash.xxh3_64_intdigest(f"set\0{me}\0{p}".encode())  # noqa: E731
    return sorted((p for p in everyone if p != me), key=score, reverse=True)[: fleet.peers]


def simulate(fleet: Fleet) -> Outcome:
    """Fill every cold node of `fleet`; when each was ready and who served what."""
    size = fleet.set_bytes // fleet.pieces
    name = lambda n: WARM if n == -1 else f"node{n}"  # noqa: E731
    schedules = [Schedule([size] * fleet.pieces, name(n), fleet.width) for n in range(fleet.nodes)]
    watchers: dict[int, list[int]] = {n: [] for n in range(-1, fleet.nodes)}
    for n, schedule in enumerate(schedules):
        for p in _known_peers(fleet, n):
            schedule.add(name(p), Tier.PEER, fleet.depth, None if p == -1 else ())
            watchers[p].append(n)
        if fleet.store_rate:
            schedule.add(STORE, Tier.STORE, fleet.depth)
        schedule.add(FILES, Tier.FILES, fleet.depth)
    servers: dict[int | str, _Server] = {
        n: _Server(n, fleet.serve_slots, fleet.link / fleet.serve_slots) for n in watchers
    }
    servers[STORE] = _Server(STORE, fleet.store_slots, fleet.store_rate / fleet.store_slots)
    per_request = fleet.link / fleet.width
    # (time it lands, order, receiver, piece, source: a node, STORE or FILES); piece -1: a
    # receiver's wake-up, when a source it waits for has rested.
    events: list[tuple[float, int, int, int, int | str]] = []
    waking: set[tuple[int, float]] = set()
    order = itertools.count()
    asked: dict[tuple[int, int, str], float] = {}
    ready = [0.0] * fleet.nodes
    served = {"warm": 0, "peers": 0, "store": 0, "files": 0}

    def begin(now: float, server: _Server, receiver: int, piece: int) -> None:
        server.free -= 1
        lands = now + size / min(server.rate, per_request)
        heapq.heappush(events, (lands, next(order), receiver, piece, server.source))

    def request(now: float, receiver: int) -> None:
        schedule = schedules[receiver]
        for piece, source in schedule.start(now):
            asked[receiver, piece, source] = now
            if source == FILES:
                # The node's own disk, at a request's rate: never the shared part.
                heapq.heappush(
                    events, (now + size / per_request, next(order), receiver, piece, FILES)
                )
                continue
            server = servers[_node(source)]
            if server.free:
                begin(now, server, receiver, piece)
            else:
                schedule.busy(piece, source, now)
        wake = schedule.wake()
        if wake is not None and wake > now and (receiver, wake) not in waking:
            waking.add((receiver, wake))
            heapq.heappush(events, (wake, next(order), receiver, -1, FILES))

    for n in range(fleet.nodes):
        request(0.0, n)
    while events:
        now, _, receiver, piece, src = heapq.heappop(events)
        if piece < 0:
            waking.discard((receiver, now))
            request(now, receiver)
            continue
        source = src if isinstance(src, str) else name(src)
        schedules[receiver].landed(piece, source, now - asked.pop((receiver, piece, source)))
        served[_kind(src)] += size
        if src != FILES:
            servers[src].free += 1
        if schedules[receiver].done and not ready[receiver]:
            ready[receiver] = now
        for watcher in watchers[receiver]:
            if schedules[watcher].holds(name(receiver), (piece,)):
                request(now, watcher)
        request(now, receiver)
    return Outcome(ready, served)


def _node(source: str) -> int | str:
    """The simulation's key of a schedule's source name."""
    if source in (STORE, FILES):
        return source
    return -1 if source == WARM else int(source.removeprefix("node"))


def _kind(src: int | str) -> str:
    if isinstance(src, str):
        return src
    return "warm" if src == -1 else "peers"
