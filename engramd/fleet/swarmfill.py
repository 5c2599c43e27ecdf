"""A fill from several peers at once, piece by piece, as swarm.Schedule decides.

Each peer tried gets a Fill stream (peerstream.py); those that offer the
set, attested, become sources of the schedule with the pieces they hold (a
peer that is filling the set too holds some, and tells of more as it
verifies them). One transfer process of the fill's own reads every granted
piece, from whichever peer granted it, into a slot of one landing ring
(landing.py), from which the daemon moves it into the staged set and
compares its digest with the attested piece digest. A piece that differs
names its sender a liar: the sender is dropped and the piece asked of
another. Once this node holds a verified piece it offers the set's verified
pieces to other peers too (filling.py), so a fleet of cold nodes fills from
each other and not all from the one warm node.

With `--object-store`, the store is one more source of the schedule, which
holds every piece (swarm.py's STORE tier): a second transfer process of the
fill's own, with the OBJ backend and the store's keys and no UCX (nothing
listens there), reads the pieces it is asked for into a landing ring of its
own, and each is compared with the attested piece digest like any other. A
read of the store that fails drops the store for the fill, and its slot is
never used again (NIXL reports a request of several ranges failed while the
others may still be landing).

Peers that did not offer the set (not held, or not filling yet) and peers
whose stream broke are asked again every REASK_S while the fill runs; liars
and peers below the rate floor are not. When pieces are needed that no live
source holds, and no peer may come back or nothing changed for STALL_S,
those pieces come from the node's own files (swarm.py's FILES tier,
compared with the attested digests like any piece).

Whoever reaches the receiving transfer process's UCX port can end it. When
it ends, another takes its place (a new landing ring, the peers' metadata
added again) and the reads that were on the wire are asked again; the
pieces verified are kept. A peer whose serving process ended with it (UCX
ends a process whose endpoint failed mid-read) refuses that metadata, and
is asked again for a new stream. After RESTARTS, no peer is asked for the
rest of the fill: the object store and the files give what is still needed.

Each kind of source is an object with one interface (start a piece, a piece
it sent wrong): a peer, the store, the files; the schedule names which. The
loop hears of everything else as typed events on one queue (Replied,
StreamEnded, Moved, FilesRead, FilesFailed, Answered). Everything here runs
on the loader's thread, but the streams' listeners and the landing's movers,
which only put events on that queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from engramd.backings.regions import Region
from engramd.fleet.base import SourceFailed, read_piece, spot_check_set
from engramd.fleet.filling import Filling, FillingSets
from engramd.fleet.landing import Landing
from engramd.fleet.nixlxfer import Agent, TransferFailed
from engramd.fleet.objstore import ObjectStoreSource, object_ranges
from engramd.fleet.peerstream import PeerStream, Replied, StreamEnded
from engramd.fleet.swarm import Schedule, Tier
from engramd.fleet.trust import FleetKey, check_received
from engramd.sets.seams import Filled, FillProgress
from engramd.strong import set_pieces
from engramd_shared.checkpoint import TablePlan
from engramd_shared.pb import peer_pb2

log = logging.getLogger("engramd")

#: Peers asked at once for one fill, the first in this node's order for the set.
MAX_PEERS = 8
#: Pieces in flight at once, over every peer.
WIDTH = 8
#: Pieces in flight at once from one peer, at most.
DEPTH = 4
#: Seconds between two tries of the peers that did not offer the set or dropped out.
REASK_S = 0.5
#: Seconds a fill waits, with pieces needed that no live peer holds and nothing landing,
#: before it gives up.
STALL_S = 5.0
#: Seconds a piece may wait for its grant, or take, when no rate floor is set (a peer gone
#: silent).
PIECE_TIMEOUT_S = 60.0
#: Seconds of a peer's part in a fill after which its rate is judged against the floor.
FLOOR_AFTER_S = 2.0
#: Seconds between two looks at the reads in flight.
POLL_S = 0.002
#: Seconds between two judgements of the peers and of what no peer holds: each looks at every
#: piece still needed, too much to do at every look at the reads of a set of 12,000 pieces.
JUDGE_S = 0.1
#: The node's own files as a source of the pieces no live peer holds, and its reads at once.
FILES = "files"
FILES_DEPTH = 2
#: Pieces in flight at once from the object store.
STORE_DEPTH = 4
#: Times a fill starts another receiving transfer process when its own ends: whoever reaches
#: its UCX port can end it at will, and a 189 GiB fill should not start over for that.
RESTARTS = 2


@dataclass(frozen=True)
class Moved:
    """A piece's bytes were written into the staged set and digested: `good` when the
    digest is the attested one; `source` gave them, in `seconds`."""

    piece: int
    source: str
    good: bool
    seconds: float


@dataclass(frozen=True)
class FilesRead:
    """A piece read from the node's own files, asked for at `asked`."""

    piece: int
    data: bytearray
    asked: float


@dataclass(frozen=True)
class FilesFailed:
    """A piece could not be read from the node's own files."""

    piece: int
    why: str


@dataclass(frozen=True)
class Answered:
    """A peer asked again answered (its stream, or why not, is in the future asked with)."""

    address: str


#: What the fill's loop hears from the threads around it.
Event = Replied | StreamEnded | Moved | FilesRead | FilesFailed | Answered


class _Source(Protocol):
    """One source of the fill's pieces as the loop drives it: a peer, the object store or
    the node's own files, each named as the schedule and status name it."""

    name: str
    #: Whether it is a peer (status lists the peers apart from the rest).
    peer: bool

    def start(self, piece: int, now: float) -> None:
        """Start getting `piece`; it arrives as an event, or fails through the schedule."""

    def lied(self, piece: int, why: str) -> None:
        """`piece` from it had another digest than the attested one (`why`, in words)."""


class _Peer:
    """A peer's stream as a source: pieces asked for, granted, then read over NIXL."""

    peer = True

    def __init__(self, fill: SwarmFill, stream: PeerStream) -> None:
        self._fill = fill
        self._stream = stream
        self.name = stream.address

    def start(self, piece: int, now: float) -> None:
        self._fill._ask(self._stream, piece, now)

    def lied(self, piece: int, why: str) -> None:
        self._fill._liar(f"peer {self.name}", self.name, piece, why)


class _Store:
    """The object store as a source of single pieces, read by its own transfer process."""

    peer = False

    def __init__(self, fill: SwarmFill, name: str) -> None:
        self._fill = fill
        self.name = name

    def start(self, piece: int, now: float) -> None:
        self._fill._from_store(piece, now)

    def lied(self, piece: int, why: str) -> None:
        self._fill._liar(self.name, self.name, piece, why)


class _Files:
    """The node's own files as a source of the pieces no live peer holds."""

    peer = False
    name = FILES

    def __init__(
        self, fill: SwarmFill, plan: TablePlan, pieces: list[tuple[int, int, int]]
    ) -> None:
        self._fill = fill
        self._plan = plan
        self._pieces = pieces

    def start(self, piece: int, now: float) -> None:
        self._fill._from_files(piece, now)

    def lied(self, piece: int, why: str) -> None:
        index, at, _ = self._pieces[piece]
        raise SourceFailed(
            f"this node's checkpoint files give piece {piece} (tensor "
            f"{self._plan.tensors[index].name!r}, bytes {at}..) another digest than the "
            "fleet attested: they are not the checkpoint the fleet's set was loaded from"
        )


@dataclass
class _StoreRead:
    """A piece being read from the object store."""

    piece: int
    slot: int
    asked: float
    deadline: float


@dataclass
class _Read:
    """A granted piece on the wire."""

    piece: int
    stream: PeerStream
    slot: int
    asked: float
    deadline: float


def opened(
    addresses: list[str], plan: TablePlan, key: FleetKey, pool: ThreadPoolExecutor
) -> list[Future[PeerStream]]:
    """A stream opened to each of `addresses` at once, on `pool` (each raises SourceFailed)."""

    def open_one(address: str) -> PeerStream:
        stream = PeerStream(address)
        try:
            stream.open(plan, key)
        except BaseException:
            stream.close()
            raise
        return stream

    return [pool.submit(open_one, a) for a in addresses]


class SwarmFill:
    """One fill of the set of `plan` into `regions` from the peers at `addresses` (and the
    object store, `store`); `receiver`: this node's identity, which orders the pieces it asks
    for first."""

    def __init__(
        self,
        plan: TablePlan,
        regions: list[Region],
        progress: FillProgress,
        key: FleetKey,
        min_rate: int,
        filling: FillingSets,
        store: ObjectStoreSource | None,
        receiver: str,
    ) -> None:
        self._plan = plan
        self._store = store
        self._regions = regions
        self._progress = progress
        self._key = key
        self._min_rate = min_rate
        self._board = filling
        self._pieces = set_pieces([t.nbytes for t in plan.tensors])
        self._schedule = Schedule([n for _, _, n in self._pieces], receiver, WIDTH)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._streams: dict[str, PeerStream] = {}
        #: Every source the schedule may start a piece from, by its name there.
        self._sources: dict[str, _Source] = {}
        #: Pieces asked of each peer, not yet granted: when each was asked.
        self._asked: dict[tuple[int, str], float] = {}
        self._reads: dict[int, _Read] = {}
        #: Pieces whose bytes are moving into the staged set (one copy of a piece at a time).
        self._moving: set[int] = set()
        self._verified: set[int] = set()
        #: Peers not asked again in this fill, and why.
        self._left: dict[str, str] = {}
        #: Peers being asked again, and when each was last asked.
        self._asking: dict[str, Future[PeerStream]] = {}
        self._last_asked: dict[str, float] = {}
        #: When each peer got its first request.
        self._first_ask: dict[str, float] = {}
        #: Verified bytes each peer gave, over all its streams.
        self._delivered: dict[str, int] = {}
        self._changed = time.monotonic()
        self._first: PeerStream | None = None
        self._offered: Filling | None = None
        self._agent: Agent | None = None
        #: The peer whose route names the interface the receiving transfer process uses.
        self._route = ""
        self._restarts = 0
        #: Why no peer is asked any more in this fill ("": they are).
        self._no_peers = ""
        self._landing: Landing | None = None
        #: The object store's transfer process, its objects' devices, its landing ring and
        #: its reads in flight (none: no store, or it could not start).
        self._store_agent: Agent | None = None
        self._store_devices: dict[str, int] = {}
        self._store_ring = 0
        self._store_reads: dict[int, _StoreRead] = {}
        self._pool = ThreadPoolExecutor(MAX_PEERS, "engramd-peer-open")

    def run(self, addresses: list[str]) -> Filled:
        """Fill from the peers; the digests and the attestation they matched."""
        # The transfer process starts its backend and maps its landing ring while the
        # peers offer.
        starting = self._pool.submit(self._receiving, addresses[0])
        try:
            return self._run(addresses, starting)
        finally:
            for stream in self._streams.values():
                stream.close()
            # A peer still being asked again is closed once it answers; the fill does not wait.
            for asking in self._asking.values():
                asking.add_done_callback(_close_opened)
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._offered is not None:
                self._board.end(self._offered)
            with contextlib.suppress(SourceFailed):
                self._landing = self._landing or starting.result()
            if self._landing is not None:
                self._landing.close()
            if self._agent is not None:
                self._agent.close()
            if self._store_agent is not None:
                self._store_agent.close()

    def _receiving(self, address: str) -> Landing:
        self._route = address
        self._agent = Agent({"UCX": {}}, peer=address)
        landing = Landing(self._agent, self._regions, WIDTH)
        if self._store is not None:
            try:
                self._store_agent = self._store.agent()
                self._store_devices = self._store.register(self._store_agent, self._plan)
                self._store_ring = landing.add_ring(self._store_agent, STORE_DEPTH)
            except (TransferFailed, OSError) as e:
                log.warning(
                    "set %s: %s gives no pieces (%s); the peers and the files give them",
                    self._plan.set_id,
                    self._store.url,
                    e,
                )
                if self._store_agent is not None:
                    self._store_agent.close()
                    self._store_agent = None
        return landing

    def _run(self, addresses: list[str], starting: Future[Landing]) -> Filled:
        streams = opened(addresses, self._plan, self._key, self._pool)
        for address, future in zip(addresses, streams, strict=True):
            try:
                self._join(future.result(), time.monotonic())
            except SourceFailed as e:
                # A peer without the set (not loaded or not filling yet) is routine in a fleet
                # that starts together; anything else is worth an operator's look.
                level = logging.INFO if str(e).startswith("NOT_FOUND") else logging.WARNING
                log.log(level, "set %s: peer %s: %s", self._plan.set_id, address, e)
                self._last_asked[address] = time.monotonic()
        if self._first is None:
            raise SourceFailed(f"none of {len(addresses)} peer(s) offers the set")
        names = sorted(self._streams)
        self._progress.restart(
            f"peer {names[0]}" if len(names) == 1 else f"peers {', '.join(names)}"
        )
        self._landing = starting.result()
        self._loop(addresses)
        assert self._landing is not None and self._first.manifest is not None
        got = self._landing.digests()
        strong = self._first.strong
        check_received([t.name for t in self._plan.tensors], strong, got, "a peer sent other bytes")
        spot_check_set(self._plan, [r.view() for r in self._regions])
        self._report()
        # What gave the bytes, as status names it: the peers that did, the store, the files.
        others = [n for n, f in self._sources.items() if not f.peer and n in self._delivered]
        peers = sorted(set(self._delivered) - set(others))
        named = [f"peer {peers[0]}" if len(peers) == 1 else f"peers {', '.join(peers)}"]
        if self._delivered:
            self._progress.source = ", ".join((named if peers else []) + others)
        # Every byte has the attested strong digest: the attested checksums are theirs.
        return Filled(
            [t.checksum for t in self._first.manifest.tensors], got, self._first.offer.attestation
        )

    def _join(self, stream: PeerStream, now: float) -> None:
        """Make `stream`'s peer a source of the fill."""
        if self._first is None:
            self._first = stream
        elif stream.strong != self._first.strong:
            # Other strong digests under the same set id: one of the two peers lies, and
            # their pieces cannot be compared with one another.
            stream.close()
            raise SourceFailed("it offers the set under other strong digests than the first peer")
        self._streams[stream.address] = stream
        self._sources[stream.address] = _Peer(self, stream)
        self._schedule.add(stream.address, Tier.PEER, DEPTH, stream.held)
        self._changed = now
        stream.listen(self._events.put)

    # -- the loop -----------------------------------------------------------------------

    def _loop(self, addresses: list[str]) -> None:
        assert self._agent is not None and self._landing is not None
        assert self._first is not None
        self._landing.expect(self._first.pieces)
        if self._store_agent is not None:
            self._sources[self._store_name()] = _Store(self, self._store_name())
            self._schedule.add(self._store_name(), Tier.STORE, STORE_DEPTH)
        judged = 0.0
        while not self._schedule.done:
            try:
                judged = self._step(addresses, judged)
            except TransferFailed as e:
                if self._no_peers or not self._agent.ended():
                    raise
                self._restart(self._ending(e))

    def _step(self, addresses: list[str], judged: float) -> float:
        """One turn of the loop: start what the schedule says, handle what happened; when
        the peers and the files were last judged."""
        now = time.monotonic()
        if self._progress.cancel.is_set():
            raise SourceFailed("the load was cancelled")
        self._add_remotes()
        self._ask_again(addresses, now)
        for piece, name in self._schedule.start(now):
            self._sources[name].start(piece, now)
        try:
            reading = self._reads or self._store_reads
            event = self._events.get(timeout=POLL_S if reading else REASK_S / 5)
        except queue.Empty:
            pass
        else:
            self._handle(event, now)
            while True:
                try:
                    self._handle(self._events.get_nowait(), now)
                except queue.Empty:
                    break
        self._poll(time.monotonic())
        self._poll_store(time.monotonic())
        if time.monotonic() >= judged + JUDGE_S:
            judged = time.monotonic()
            self._judge(judged)
        return judged

    def _ask(self, stream: PeerStream, piece: int, now: float) -> None:
        """Ask `stream`'s peer for `piece`: its grant comes as an event."""
        self._first_ask.setdefault(stream.address, now)
        self._asked[(piece, stream.address)] = now
        stream.ask(piece)

    def _add_remotes(self) -> None:
        """Give the receiving transfer process the NIXL metadata of each peer that joined
        since, before it is asked for a piece. A peer whose metadata is refused is left; one
        whose metadata an ended process had loaded is asked again, for a new stream."""
        assert self._agent is not None
        for name, stream in list(self._streams.items()):
            if stream.remote:
                continue
            try:
                stream.remote = self._agent.add_remote(stream.offer.nixl_metadata)
            except TransferFailed as e:
                if self._agent.ended():
                    raise
                # UCX ends a process whose endpoint fails mid-request ("Fatal: unexpected
                # error: Endpoint timeout"): the peer's serving process may have ended with
                # ours, and its next stream gets a new one (fleet/exports.py).
                again = stream.loaded_before
                log.warning(
                    "set %s: peer %s: %s; %s",
                    self._plan.set_id,
                    name,
                    e,
                    "asked again" if again else "left",
                )
                self._lose(name, str(e), again=again)

    def _restart(self, why: str) -> None:
        """The receiving transfer process ended (`why`): its reads are asked again of the same
        peers through another, the verified pieces kept; after RESTARTS, the peers are left
        and the object store and the files give the rest."""
        assert self._agent is not None and self._landing is not None
        for read in self._reads.values():
            read.stream.done(read.piece)
            self._schedule.cancel(read.piece, read.stream.address)
        self._reads.clear()
        while True:
            self._agent.close()
            kept = len(self._verified)
            if self._restarts == RESTARTS:
                self._no_peers = (
                    f"the receiving transfer process ended {RESTARTS + 1} times, the last: {why}"
                )
                log.warning(
                    "set %s: %s; %d verified pieces kept, the rest from the object store and "
                    "the files",
                    self._plan.set_id,
                    self._no_peers,
                    kept,
                )
                for name in list(self._streams):
                    self._lose(name, self._no_peers, again=False)
                self._last_asked.clear()
                self._landing.retire()
                return
            self._restarts += 1
            log.warning(
                "set %s: %s; another takes its place, %d verified pieces kept",
                self._plan.set_id,
                why,
                kept,
            )
            try:
                self._agent = Agent({"UCX": {}}, peer=self._route)
            except TransferFailed as e:
                why = f"another could not start ({e})"
                continue
            try:
                self._landing.renew(self._agent, WIDTH)
            except TransferFailed as e:
                why = self._ending(e)
                continue
            # The next turn of the loop gives the new process the peers' metadata.
            for stream in self._streams.values():
                stream.loaded_before = stream.loaded_before or bool(stream.remote)
                stream.remote = ""
            return

    def _ending(self, failed: TransferFailed) -> str:
        """Why the receiving transfer process failed `failed`: how it ended, if it did."""
        assert self._agent is not None
        ended = self._agent.ended()
        return f"the receiving transfer process {ended}" if ended else str(failed)

    def _handle(self, event: Event, now: float) -> None:
        match event:
            case Replied(stream, reply):
                if self._streams.get(stream.address) is stream:
                    self._reply(stream, reply, now)
            case StreamEnded(stream, why):
                if self._streams.get(stream.address) is stream:
                    log.warning(
                        "set %s: peer %s: %s; the others give its pieces",
                        self._plan.set_id,
                        stream.address,
                        why,
                    )
                    self._lose(stream.address, why, again=True)
            case Moved(piece, source, good, seconds):
                self._moved(piece, source, good, seconds)
            case FilesRead(piece, data, asked):
                self._put(piece, data, asked)
            case FilesFailed(piece, why):
                raise SourceFailed(
                    f"piece {piece} cannot be read from the checkpoint's files ({why})"
                )
            case Answered(address):
                future = self._asking.pop(address)
                if self._no_peers:
                    _close_opened(future)
                    return
                try:
                    self._join(future.result(), now)
                except SourceFailed as e:
                    log.debug("set %s: peer %s: %s", self._plan.set_id, address, e)
                else:
                    log.info("set %s: peer %s joined the fill", self._plan.set_id, address)

    def _reply(self, stream: PeerStream, reply: peer_pb2.FillReply, now: float) -> None:
        name = stream.address
        step = reply.WhichOneof("step")
        if step == "holding":
            try:
                held = stream.news(reply.holding, len(self._pieces))
            except ValueError:
                self._lose(name, "it named the pieces it holds wrongly", again=False)
                return
            if self._schedule.holds(name, held):
                self._changed = now
        elif step == "busy":
            if self._asked.pop((reply.busy, name), None) is not None:
                if any(r.stream is stream for r in self._reads.values()):
                    self._schedule.full(reply.busy, name)
                else:
                    self._schedule.busy(reply.busy, name, now)
        elif step == "missing":
            if self._asked.pop((reply.missing, name), None) is not None:
                self._schedule.failed(reply.missing, name, "it does not hold the piece")
        elif step == "piece":
            asked = self._asked.pop((reply.piece, name), None)
            if asked is None:
                self._lose(name, "it granted a piece not asked for", again=False)
                return
            self._read(stream, reply.piece, asked, now)
        else:
            self._lose(name, f"it answered a piece request with {step}", again=False)

    def _read(self, stream: PeerStream, piece: int, asked: float, now: float) -> None:
        assert self._agent is not None and self._landing is not None
        if piece in self._verified or piece in self._moving:
            # Another request of it landed first; this one is moot, and its slot there free.
            stream.done(piece)
            self._schedule.cancel(piece, stream.address)
            return
        index, at, n = self._pieces[piece]
        slot, there = self._landing.slot()
        address = stream.offer.regions[index].address + at
        try:
            handle = self._agent.post([(there, n, 0)], [(address, n, 0)], "DRAM", stream.remote)
        except TransferFailed as e:
            self._landing.discard(slot)
            stream.done(piece)
            if self._agent.ended():
                self._schedule.cancel(piece, stream.address)
                raise
            # This peer's read could not start (NIXL refused it): a failure of that peer's.
            log.warning("set %s: peer %s: %s", self._plan.set_id, stream.address, e)
            self._schedule.failed(piece, stream.address, str(e))
            return
        deadline = now + (
            max(n / self._min_rate, 1.0) * (DEPTH + 3) if self._min_rate else PIECE_TIMEOUT_S
        )
        self._reads[handle] = _Read(piece, stream, slot, asked, deadline)

    def _poll(self, now: float) -> None:
        assert self._agent is not None and self._landing is not None
        if not self._reads:
            return
        for handle, state in self._agent.states(list(self._reads)).items():
            read = self._reads.pop(handle)
            name = read.stream.address
            read.stream.done(read.piece)
            if state != "DONE":
                self._landing.discard(read.slot)
                self._schedule.failed(read.piece, name, "the read failed")
            elif read.piece in self._verified or read.piece in self._moving:
                self._landing.discard(read.slot)
                self._schedule.cancel(read.piece, name)
            else:
                self._moving.add(read.piece)
                index, at, _ = self._pieces[read.piece]
                self._landing.landed(
                    read.slot, index, at, self._then(read.piece, name, now - read.asked)
                )
        for handle, read in list(self._reads.items()):
            if now > read.deadline:
                # Its slot stays taken: the read may still land there.
                del self._reads[handle]
                read.stream.done(read.piece)
                self._schedule.failed(read.piece, read.stream.address, "the read outlived it")

    def _store_name(self) -> str:
        """The object store as the schedule and status name it ("" without one)."""
        return self._store.url if self._store is not None else ""

    def _from_store(self, piece: int, now: float) -> None:
        """Start reading `piece` from the object store into a slot of its ring."""
        assert self._store_agent is not None and self._landing is not None
        index, at, n = self._pieces[piece]
        slot, there = self._landing.slot(self._store_ring)
        spans = object_ranges(self._plan.tensors[index], at, n, self._store_devices)
        try:
            handle = self._store_agent.post(
                [(there + into, size, 0) for into, (_, size, _) in spans],
                [where for _, where in spans],
                "OBJ",
                self._store_agent.name,
            )
        except TransferFailed as e:
            self._store_failed(piece, str(e))
            return
        self._store_reads[handle] = _StoreRead(piece, slot, now, now + PIECE_TIMEOUT_S)

    def _poll_store(self, now: float) -> None:
        if not self._store_reads:
            return
        assert self._store_agent is not None and self._landing is not None
        name = self._store_name()
        try:
            ended = self._store_agent.states(list(self._store_reads))
        except TransferFailed as e:
            for read in self._store_reads.values():
                self._store_failed(read.piece, str(e))
            self._store_reads.clear()
            return
        for handle, state in ended.items():
            read = self._store_reads.pop(handle)
            if state != "DONE":
                # Its other ranges may still be landing: its slot is never used again.
                self._store_failed(read.piece, f"a read of piece {read.piece} failed")
            elif read.piece in self._verified or read.piece in self._moving:
                self._landing.discard(read.slot, self._store_ring)
                self._schedule.cancel(read.piece, name)
            else:
                self._moving.add(read.piece)
                index, at, _ = self._pieces[read.piece]
                then = self._then(read.piece, name, now - read.asked)
                self._landing.landed(read.slot, index, at, then, self._store_ring)
        for handle, read in list(self._store_reads.items()):
            if now > read.deadline:
                del self._store_reads[handle]
                self._store_failed(read.piece, f"piece {read.piece} took over {PIECE_TIMEOUT_S} s")

    def _store_failed(self, piece: int, why: str) -> None:
        """A read of the store failed: the store is dropped for the fill."""
        name = self._store_name()
        self._schedule.failed(piece, name, why)
        if not self._schedule.sources[name].dropped:
            log.warning(
                "set %s: %s: %s; the peers and the files give its pieces",
                self._plan.set_id,
                name,
                why,
            )
            self._schedule.drop(name, why)

    def _from_files(self, piece: int, now: float) -> None:
        """Read `piece` from the checkpoint's files on the pool; it lands as an event."""
        index, at, n = self._pieces[piece]
        entry = self._plan.tensors[index]

        def read() -> None:
            try:
                data = read_piece(entry, at, n)
            except (OSError, SourceFailed) as e:
                self._events.put(FilesFailed(piece, str(e)))
                return
            self._events.put(FilesRead(piece, data, now))

        self._pool.submit(read)

    def _put(self, piece: int, data: bytearray, asked: float) -> None:
        assert self._landing is not None
        if piece in self._verified or piece in self._moving:
            self._schedule.cancel(piece, FILES)
            return
        self._moving.add(piece)
        index, at, _ = self._pieces[piece]
        seconds = time.monotonic() - asked

        def moved(good: bool) -> None:
            self._events.put(Moved(piece, FILES, good, seconds))

        self._landing.put(index, at, data, moved)

    def _then(self, piece: int, name: str, seconds: float) -> Callable[[bool], None]:
        def moved(good: bool) -> None:
            self._events.put(Moved(piece, name, good, seconds))

        return moved

    def _moved(self, piece: int, name: str, good: bool, seconds: float) -> None:
        self._moving.discard(piece)
        if not good:
            index, at, _ = self._pieces[piece]
            why = (
                f"it sent piece {piece} (tensor {self._plan.tensors[index].name!r}, bytes "
                f"{at}..) with another digest than the attested one"
            )
            self._sources[name].lied(piece, why)
            return
        self._verified.add(piece)
        self._changed = time.monotonic()
        self._schedule.landed(piece, name, seconds)
        self._delivered[name] = self._delivered.get(name, 0) + self._pieces[piece][2]
        self._offer().mark(piece)
        self._progress.add(self._pieces[piece][2], name)

    def _liar(self, what: str, name: str, piece: int, why: str) -> None:
        """Source `name` (`what`, as the log says it) sent `piece` wrong: dropped for good."""
        log.warning("set %s: %s: %s; dropped", self._plan.set_id, what, why)
        self._schedule.failed(piece, name, why, lied=True)
        self._lose(name, why, again=False)

    def _offer(self) -> Filling:
        """This fill as offered to other peers, from its first verified piece on."""
        if self._offered is None:
            first = self._first
            assert first is not None
            self._offered = Filling(
                self._plan.set_id,
                first.offer.manifest_json,
                first.offer.attestation,
                first.strong,
                list(first.offer.piece_digests),
                [(os.dup(r.fd), r.offset, r.nbytes) for r in self._regions],
                [n for _, _, n in self._pieces],
            )
            self._board.start(self._offered)
        return self._offered

    def _judge(self, now: float) -> None:
        """Drop peers silent for PIECE_TIMEOUT_S or below the rate floor; when pieces are
        needed that no live peer holds, read them from the files or give up."""
        silent = {name for (_, name), asked in self._asked.items() if now - asked > PIECE_TIMEOUT_S}
        for name in sorted(silent):
            why = f"no answer to a piece request within {PIECE_TIMEOUT_S:.0f} s"
            log.warning(
                "set %s: peer %s: %s; the others give its pieces", self._plan.set_id, name, why
            )
            self._lose(name, why, again=True)
        for name, first in list(self._first_ask.items()):
            source = self._schedule.sources[name]
            elapsed = now - first
            if (
                self._min_rate
                and not source.dropped
                and elapsed > FLOOR_AFTER_S
                and source.delivered / elapsed < self._min_rate
            ):
                why = (
                    f"too slow: {source.delivered / elapsed / 1e6:.0f} MB/s, below the floor "
                    f"of {self._min_rate / 1e6:.0f} MB/s (--peer-min-rate)"
                )
                log.warning("set %s: peer %s: %s; dropped", self._plan.set_id, name, why)
                self._lose(name, why, again=False)
        if not self._schedule.stuck():
            return
        # Peers that may come back (asked again) get STALL_S; when none may, there is no wait.
        waiting = not self._no_peers and bool(self._last_asked or self._asking)
        if waiting and now - self._changed <= STALL_S:
            return
        left = "; ".join(f"peer {a}: {why}" for a, why in sorted(self._left.items()))
        why = (
            "no peer left holds every piece still needed"
            + (f" after {STALL_S:.0f} s" if waiting else "")
            + (f" ({left})" if left else "")
        )
        if FILES in self._sources:
            raise SourceFailed(why)
        if self._plan.store:
            raise SourceFailed(f"{why}, and this node holds no file of the checkpoint")
        log.warning("set %s: %s; those pieces come from the files", self._plan.set_id, why)
        self._sources[FILES] = _Files(self, self._plan, self._pieces)
        self._schedule.add(FILES, Tier.FILES, FILES_DEPTH)

    def _lose(self, name: str, why: str, again: bool) -> None:
        """Peer `name` is no source any more: its stream ends, its pieces asked go back;
        `again`: it may be asked again later."""
        stream = self._streams.pop(name, None)
        if stream is not None:
            stream.close()
        for piece, asked_of in [k for k in self._asked if k[1] == name]:
            del self._asked[(piece, asked_of)]
            self._schedule.failed(piece, name, why)
        self._schedule.drop(name, why)
        self._first_ask.pop(name, None)
        self._left[name] = why
        if again:
            self._last_asked[name] = time.monotonic()
        else:
            self._last_asked.pop(name, None)

    def _ask_again(self, addresses: list[str], now: float) -> None:
        """Open a stream again to each peer that did not offer the set, or whose stream broke,
        REASK_S after it was last asked."""
        if self._no_peers:
            return
        for address in addresses:
            last = self._last_asked.get(address)
            if (
                address in self._streams
                or address in self._asking
                or last is None
                or now - last < REASK_S
            ):
                continue
            self._last_asked[address] = now
            (future,) = opened([address], self._plan, self._key, self._pool)
            self._asking[address] = future
            future.add_done_callback(partial(self._answered, address))

    def _answered(self, address: str, _: Future[PeerStream]) -> None:
        self._events.put(Answered(address))

    def _report(self) -> None:
        """One line: what each peer gave."""
        total = sum(n for _, _, n in self._pieces) or 1
        parts = [f"{name} {100 * n / total:.0f}%" for name, n in sorted(self._delivered.items())]
        log.info("set %s: filled from peers: %s", self._plan.set_id, ", ".join(parts))


def _close_opened(future: Future[PeerStream]) -> None:
    """A stream opened after its fill ended: closed."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()
