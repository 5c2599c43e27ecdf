"""The peer port (--peer-listen): operator-published sets handed to the fleet's other daemons,
and the verified pieces of those this node is filling from them.

PeerService.Fill over TCP, both ends authenticated by a challenge-response
over the fleet's shared token (sources/trust.py: this server proves it
first, the receiver then; the token never travels), the offer's digests
(checksums and strong digests) attested with the fleet's key. A set this
node loaded from its files gets its strong and piece digests from its
published copy's pages on the first offer of that copy (on a thread of their
own, every core hashing), kept for later offers: a copy never changes once
published. A set this node filled is offered with the origin's strong
digests and attestation, kept in its manifest (its pages are hashed on the
first offer too, for the piece digests, and must give the attested strong
digests). A set this node is filling from peers is offered with what its
origin offered, and only its pieces verified here are granted
(sources/filling.py); its receivers are told as more are. Only sets the
operator published (loaded by --checkpoint or `engramd load`) are offered; a
set a worker's attach loaded stays owner-only and is answered as absent, like
any set not held. A copy is mapped read-only and registered by a transfer
process of its own (Export: sources/xferproc.py says why none runs in the
daemon), shared by the streams that read it over one network interface and
ended with the last of them (Exports); the receiver reads it, a piece at a
time, each granted once the daemon's rate cap (--peer-rate, all
peers together) allows. The export is made on a pool thread, and the reads
are served by the transfer process's UCX: the worker socket's event loop
only hands out grants.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engramd.api.sockets import REQUEST_TIMEOUT_S, tcp_server
from engramd.backings.regions import Region, close_all
from engramd.errors import abort
from engramd.fleet.base import WINDOW_BYTES, SourceFailed
from engramd.fleet.filling import Filling, FillingSets
from engramd.fleet.netdev import interface_of
from engramd.fleet.nixlxfer import Agent, TransferFailed, nixl_build, spare
from engramd.fleet.trust import NONCE_BYTES, FleetKey, nonce, proven
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd.strong import Digests, digest_views, set_pieces
from engramd.units import gib
from engramd_shared.errors import InvalidRequest, NotAllowed, UnknownSet
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")

#: Seconds between two looks at a filling set's pieces, to tell a stream's receiver of new ones.
HOLDING_EVERY_S = 0.05
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


@dataclass(frozen=True)
class Offered:
    """What a receiver checks a copy with: the attestation, each tensor's strong digest and
    its pieces' digests (32 bytes each, back to back)."""

    attestation: str
    strong: list[str]
    pieces: list[bytes]


class Export:
    """Served memory: a transfer process of its own that maps only one copy (a published one,
    or the staged set of a fill), read-only, and has it registered with its NIXL agent while
    streams read it (Exports)."""

    def __init__(self, memory: list[tuple[int, int, int]], receiver: str) -> None:
        """`memory`: each tensor's (fd, offset, bytes); the caller closes the fds."""
        self.agent = Agent({"UCX": {}}, peer=receiver, serves=True)
        try:
            self._addresses = self.agent.attach(memory, writable=False)
            self._sizes = [n for _, _, n in memory]
            self._metadata = self.agent.metadata()
        except BaseException:
            self.agent.close()
            raise

    def offer(self, manifest_json: str, offered: Offered, held: bytes) -> peer_pb2.SetOffer:
        """The copy described for the receiver: manifest, digests, their attestation, which
        pieces it holds (b"": all), where it lies."""
        return peer_pb2.SetOffer(
            manifest_json=manifest_json,
            nixl_metadata=self._metadata,
            regions=[
                peer_pb2.RemoteRegion(address=a, nbytes=n)
                for a, n in zip(self._addresses, self._sizes, strict=True)
            ],
            attestation=offered.attestation,
            strong_digests=offered.strong,
            piece_digests=offered.pieces,
            held=held,
        )

    def ended(self) -> str:
        """Why the transfer process ended before the stream did ("" while it runs)."""
        return self.agent.ended()

    def close(self) -> None:
        """End the transfer process: nothing of the copy is reachable any more."""
        self.agent.close()


def published_memory(ts: TableSet) -> list[tuple[int, int, int]]:
    """Each tensor of a published copy as (fd, offset, bytes), with descriptors of the
    caller's own (to close)."""
    assert ts.manifest is not None
    opened = ts.backing.descriptors(ts.manifest)
    fds = dict(opened)
    memory = [(os.dup(fds[t.file]), t.offset, t.nbytes) for t in ts.manifest.tensors]
    for _, fd in opened:
        os.close(fd)
    return memory


def receiver_address(peer: str) -> str:
    """The IP of a gRPC peer string ("ipv4:10.0.0.2:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest[1 : rest.index("]")]
    return rest.rpartition(":")[0]


class _Served:
    """What one stream serves: a published copy, or the held pieces of a set being filled."""

    def __init__(
        self,
        name: str,
        key: str,
        manifest_json: str,
        offered: Offered,
        memory: Callable[[], list[tuple[int, int, int]]],
        pieces: list[int],
        filling: Filling | None,
    ) -> None:
        self.name = name
        #: What a transfer process serving it is shared by: this copy, as loaded or filled.
        self.key = key
        self.manifest_json = manifest_json
        self.offered = offered
        #: Each tensor's (fd, offset, bytes), with descriptors of the caller's own.
        self.memory = memory
        #: Each piece's bytes.
        self.pieces = pieces
        self.nbytes = sum(pieces)
        self.filling = filling
        self.told = -1

    def held(self) -> bytes:
        """The bitmap of the pieces held now (b"": all); remembered as told."""
        if self.filling is None:
            return b""
        self.told, held = self.filling.held()
        return held

    def news(self) -> bytes | None:
        """The held bitmap if more pieces are held than the receiver was told of."""
        if self.filling is None or self.filling.version == self.told:
            return None
        return self.held()


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """Fill: offer a published set (or the verified pieces of one being filled), then grant
    pieces under the rate cap."""

    def __init__(self, store: SetStore, key: FleetKey, rate: int, filling: FillingSets) -> None:
        self._store = store
        self._key = key
        self._cap = RateCap(rate)
        self._filling = filling
        #: Each stream's pieces granted and not yet read, with when each was granted.
        self._granted: dict[int, dict[int, float]] = {}
        self._exports = Exports()
        self._pool = BlockingPool("peer", 2)
        # One copy digested at a time, each on every core: an Export is never queued behind.
        self._digesting = BlockingPool("peer-digest", 1)
        #: The digests of each published copy, by (copy, its manifest's nonce): a published
        #: copy's bytes never change, and a copy loaded again has another nonce.
        self._offered: dict[tuple[str, str], asyncio.Future[Offered]] = {}

    async def _served(self, set_id: str) -> _Served:
        """The published copy of `set_id`, else its fill in progress here."""
        ts = self._store.offered(set_id)
        if ts is not None:
            assert ts.manifest is not None
            tensors = ts.manifest.tensors
            return _Served(
                ts.copy,
                f"{ts.copy} {ts.manifest.nonce}",
                ts.manifest.to_json(),
                await self._offer_of(ts),
                lambda: published_memory(ts),
                [n for _, _, n in set_pieces([t.nbytes for t in tensors])],
                None,
            )
        filling = self._filling.get(set_id)
        if filling is None:
            # The same answer for a set not held and one only a worker's attach loaded.
            raise UnknownSet(f"this daemon serves no published set {set_id} to peers")
        return _Served(
            f"{set_id} (filling)",
            f"{set_id} filling {id(filling)}",
            filling.manifest_json,
            Offered(filling.attestation, filling.strong, filling.piece_digests),
            filling.descriptors,
            filling.sizes,
            filling,
        )

    async def _offer_of(self, ts: TableSet) -> Offered:
        """The attestation and digests a receiver checks the copy with, from its pages. A set
        this node filled keeps the origin's attestation (never signed again here), and its
        pages must give the attested strong digests; a set loaded from files is attested here
        (this node took its digests from its files)."""
        manifest = ts.manifest
        assert manifest is not None
        if manifest.attestation is not None and manifest.strong_digests is None:
            # Filled by an engramd that attested checksums alone: nothing to forward.
            raise UnknownSet(
                f"set {manifest.set_id} was filled by an older engramd that kept no strong "
                "digests; it is not served to peers until it is dropped and loaded again"
            )
        key = (ts.copy, manifest.nonce)
        digesting = self._offered.get(key)
        if digesting is None:
            # An earlier load of this copy is gone; its digests never count again.
            for old in [k for k in self._offered if k[0] == ts.copy]:
                del self._offered[old]
            digesting = asyncio.ensure_future(self._digest(ts))
            self._offered[key] = digesting

            def forget(done: asyncio.Future[Offered]) -> None:
                # A failed digest (the copy dropped meanwhile) is tried again next time.
                if (done.cancelled() or done.exception()) and self._offered.get(key) is done:
                    del self._offered[key]

            digesting.add_done_callback(forget)
        # Shielded: a stream that ends while its copy is hashed leaves the digest to the next.
        return await asyncio.shield(digesting)

    async def _digest(self, ts: TableSet) -> Offered:
        manifest = ts.manifest
        assert manifest is not None
        started = time.monotonic()
        got = await self._digesting.run(copy_digests, ts)
        log.info(
            "set %s: strong digests of its %s taken for peers in %.2f s",
            ts.copy,
            gib(manifest.nbytes),
            time.monotonic() - started,
        )
        pieces = [b"".join(ds) for ds in got.pieces]
        if manifest.attestation is not None:
            return Offered(manifest.attestation, got.strong, pieces)
        attested = self._key.attest(
            manifest.set_id, manifest.fingerprint, manifest.tensors, got.strong
        )
        return Offered(attested, got.strong, pieces)

    async def Fill(
        self,
        request_iterator: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """One receiver's fill of one set: each side proves it holds the token, this one
        first; then the offer, then a grant for each piece asked for."""
        opening = _Opening(self._exports)
        try:
            requests = aiter(request_iterator)
            first = await anext(requests, None)
            try:
                if first is None or first.WhichOneof("step") != "open":
                    raise InvalidRequest("a fill opens with FillOpen (set id, nonce)")
                set_id, theirs = first.open.set_id, first.open.nonce
                if len(theirs) != NONCE_BYTES:
                    raise NotAllowed("wrong peer token: give both daemons the fleet's token file")
            except Exception as e:
                await abort(context, e)
                return
            mine = nonce()
            proof = self._key.server_proof(set_id, theirs, mine)
            yield peer_pb2.FillReply(proof=peer_pb2.ServerProof(nonce=mine, proof=proof))
            try:
                # Its proof follows at once; nobody without the token holds the stream.
                second = await asyncio.wait_for(anext(requests, None), REQUEST_TIMEOUT_S)
            except TimeoutError:
                await abort(context, NotAllowed("no proof of the fleet's token in time"))
                return
            if second is None:
                # A receiver whose key our proof failed sends nothing more (the tokens differ).
                log.warning(
                    "peer %s left before proving it holds the fleet's token", context.peer()
                )
                return
            try:
                if not proven(second.proof, self._key.client_proof(set_id, theirs, mine)):
                    log.warning("peer %s: wrong token; refused", context.peer())
                    raise NotAllowed("wrong peer token: give both daemons the fleet's token file")
                served = await self._served(set_id)
                export = await self._pool.run(
                    opening.make, served, receiver_address(context.peer())
                )
            except TransferFailed as e:
                # This node's side, not the receiver's: said so, with where the fix is.
                log.warning("peer %s: %s", context.peer(), e)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the serving peer's own transfer process failed ({e}); the fix is on "
                    "that node (its log names it)",
                )
                return
            except Exception as e:
                await abort(context, e)
                return
            log.info("peer %s: filling set %s", context.peer(), served.name)
            yield peer_pb2.FillReply(
                offer=export.offer(served.manifest_json, served.offered, served.held())
            )
            started, granted = time.monotonic(), 0
            try:
                async for reply in self._grants(served, export, requests, context):
                    step = reply.WhichOneof("step")
                    if step == "piece":
                        granted += served.pieces[reply.piece]
                    elif step == "granted":
                        granted += reply.granted
                    yield reply
            finally:
                _log_served(context.peer(), served, granted, time.monotonic() - started)
        finally:
            # Not awaited: a stream the receiver cancelled may be cancelled again here.
            opening.end()

    async def _grants(
        self,
        served: _Served,
        export: Export,
        requests: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """A grant for each piece (or window) asked for, and news of the pieces held."""
        # The pieces granted on this stream and not yet read: their slots free when it ends.
        outstanding: dict[int, float] = {}
        self._granted[id(outstanding)] = outstanding
        try:
            async for reply in self._answers(served, export, requests, context, outstanding):
                yield reply
        finally:
            del self._granted[id(outstanding)]

    def _busy(self) -> bool:
        """Whether every serving slot holds a piece granted less than GRANT_HOLD_S ago."""
        since = asyncio.get_running_loop().time() - GRANT_HOLD_S
        held = sum(1 for grants in self._granted.values() for t in grants.values() if t > since)
        return held >= SERVE_SLOTS

    async def _answers(
        self,
        served: _Served,
        export: Export,
        requests: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        outstanding: dict[int, float],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        # What this stream may still be granted: the set's bytes twice over (a receiver asks
        # again for a piece whose read failed).
        left = 2 * served.nbytes
        windows = served.nbytes
        every = HOLDING_EVERY_S if served.filling is not None else None
        async for request in _with_ticks(requests, every):
            if (
                request is not None
                and request.WhichOneof("step") == "window"
                and not served.filling
            ):
                # An engramd before pieces: windows in order, the set's bytes once.
                n = request.window
                if not 0 < n <= min(WINDOW_BYTES, windows):
                    await self._refuse(
                        context,
                        served,
                        f"a window of {n} bytes: windows are 1 to {WINDOW_BYTES} bytes, and "
                        f"this fill has {windows} bytes of set {served.name} left to grant",
                    )
                windows -= n
                await self._grant(n, export, served, context)
                yield peer_pb2.FillReply(granted=n)
                continue
            if (news := served.news()) is not None:
                yield peer_pb2.FillReply(holding=news)
            if request is None:
                continue
            if request.WhichOneof("step") == "done":
                outstanding.pop(request.done, None)
                continue
            if request.WhichOneof("step") != "piece":
                break
            p = request.piece
            if not 0 <= p < len(served.pieces) or served.pieces[p] > left:
                await self._refuse(
                    context,
                    served,
                    f"piece {p}: set {served.name} has pieces 0 to {len(served.pieces) - 1}, "
                    f"and this fill has {left} bytes left to grant",
                )
            if served.filling is not None and not served.filling.holds(p):
                if served.filling.ended:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the fill of set {served.name} here ended; ask again",
                    )
                yield peer_pb2.FillReply(missing=p)
                continue
            if p in outstanding or self._busy():
                yield peer_pb2.FillReply(busy=p)
                continue
            left -= served.pieces[p]
            # The slot is held while the grant waits for the rate cap, and from the grant on.
            loop = asyncio.get_running_loop()
            outstanding[p] = loop.time()
            await self._grant(served.pieces[p], export, served, context)
            outstanding[p] = loop.time()
            yield peer_pb2.FillReply(piece=p)

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], served: _Served, why: str
    ) -> None:
        log.warning("peer %s: %s; ended", context.peer(), why)
        await abort(context, InvalidRequest(why))

    async def _grant(
        self,
        n: int,
        export: Export,
        served: _Served,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Wait for `n` bytes of the rate cap; end the stream if its transfer process died."""
        await self._cap.take(n)
        self._store.leases.stats.served(n)
        if ended := export.ended():
            # A peer wrote into the read-only copy, or read outside it.
            log.warning(
                "peer %s: the transfer process serving set %s %s; fill ended",
                context.peer(),
                served.name,
                ended,
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the transfer process {ended}")


def _log_served(receiver: str, served: _Served, granted: int, seconds: float) -> None:
    """The line a fill this node served ends with: bytes, rate, receiver."""
    log.info(
        "peer %s: served set %s: %s of %s in %.2f s (%.2f GB/s)",
        receiver,
        served.name,
        gib(granted),
        gib(served.nbytes),
        seconds,
        granted / max(seconds, 1e-9) / 1e9,
    )


async def _with_ticks(
    requests: AsyncIterator[peer_pb2.FillRequest], every: float | None
) -> AsyncIterator[peer_pb2.FillRequest | None]:
    """The stream's requests, and None each `every` seconds none came (None: no ticks)."""
    if every is None:
        async for each in requests:
            yield each
        return
    pending = asyncio.ensure_future(anext(requests, None))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            got = pending.result()
            if got is None:
                return
            yield got
            pending = asyncio.ensure_future(anext(requests, None))
    finally:
        pending.cancel()


class Exports:
    """The transfer processes serving copies: one per copy and network interface, shared by
    every stream that reads that copy over that interface (a warm node facing a fleet starts
    one, not one per receiver), ended with the last of those streams. One that died (a peer
    faulted it) is never handed out again: the next stream gets a new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[tuple[str, str], Export] = {}
        self._users: dict[int, int] = {}

    def take(self, served: _Served, receiver: str) -> tuple[tuple[str, str], Export]:
        """The export of `served` for `receiver`'s interface (made, or shared); its key."""
        try:
            key = (served.key, interface_of(receiver))
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"no network interface reaches {receiver} ({e})") from None
        # One made at a time: a stream that comes meanwhile shares it rather than making one.
        with self._lock:
            export = self._current.get(key)
            if export is not None and not export.ended():
                self._users[id(export)] += 1
                return key, export
            try:
                mapped = served.memory()
            except LookupError as e:
                raise UnknownSet(str(e)) from None
            try:
                export = Export(mapped, receiver)
            finally:
                for fd, _, _ in mapped:
                    os.close(fd)
            self._current[key] = export
            self._users[id(export)] = 1
            return key, export

    def give(self, key: tuple[str, str], export: Export) -> None:
        """A stream is done with `export`: the last one ends its transfer process."""
        with self._lock:
            self._users[id(export)] -= 1
            if self._users[id(export)]:
                return
            del self._users[id(export)]
            if self._current.get(key) is export:
                del self._current[key]
        export.close()


class _Opening:
    """The Export of one stream, taken on a pool thread while the stream may end first."""

    def __init__(self, exports: Exports) -> None:
        self._exports = exports
        self._lock = threading.Lock()
        self._taken: tuple[tuple[str, str], Export] | None = None
        self._ended = False

    def make(self, served: _Served, receiver: str) -> Export:
        """The export of `served` for `receiver`, unless the stream ended meanwhile."""
        key, export = self._exports.take(served, receiver)
        with self._lock:
            if not self._ended:
                self._taken = (key, export)
                return export
        self._exports.give(key, export)
        raise InvalidRequest("the fill ended while its set was being exported")

    def end(self) -> None:
        """The stream ended: give its Export back, now or once it is taken."""
        with self._lock:
            self._ended = True
            taken, self._taken = self._taken, None
        if taken is not None:
            self._exports.give(*taken)


def copy_digests(ts: TableSet) -> Digests:
    """Each tensor's checksum, strong digest and pieces' digests, from the pages of the
    published copy `ts` (mapped read-only here while they are hashed), of the kinds its
    manifest names.

    Raises UnknownSet when a tensor's bytes lost the checksum they were loaded
    with, or (a filled set) the attested strong digest: a copy changed since
    is never offered (a receiver checks only attested digests).
    """
    manifest = ts.manifest
    assert manifest is not None
    opened = ts.backing.descriptors(manifest)
    regions: list[Region] = []
    try:
        fds = dict(opened)
        for t in manifest.tensors:
            regions.append(Region(fds[t.file], t.offset, t.nbytes))
        got = digest_views(
            [r.view() for r in regions],
            [t.checksum for t in manifest.tensors],
            manifest.strong_digests,
        )
        attested = manifest.strong_digests or got.strong
        for t, checksum, strong, want in zip(
            manifest.tensors, got.checksums, got.strong, attested, strict=True
        ):
            if checksum != t.checksum or strong != want:
                log.warning(
                    "set %s: tensor %r of its copy no longer has the checksum it was loaded "
                    "with; not offered to peers (engramd verify %s says more)",
                    ts.copy,
                    t.name,
                    manifest.set_id,
                )
                raise UnknownSet(
                    f"this daemon's copy of set {manifest.set_id} changed since it was loaded "
                    f"(tensor {t.name!r}); it is not offered to peers"
                )
        return got
    finally:
        close_all(regions)
        for _, fd in opened:
            os.close(fd)


class PeerServer:
    """The peer port: its own gRPC server on TCP, beside the worker and admin sockets."""

    def __init__(
        self,
        store: SetStore,
        filling: FillingSets,
        address: str,
        key: FleetKey,
        rate: int,
        idle_timeout: float,
    ) -> None:
        self.address = address
        # Anyone who reaches the port may call: the TCP ports' deadlines and caps.
        self._server = tcp_server(idle_timeout)
        self._service = PeerService(store, key, rate, filling)
        peer_pb2_grpc.add_PeerServiceServicer_to_server(self._service, self._server)

    async def start(self) -> None:
        """Bind and serve; an address that cannot be bound, or NIXL missing, is an error
        naming it."""
        try:
            nixl_build()
        except SourceFailed as e:
            raise ValueError(f"--peer-listen {self.address}: {e}") from None
        spare.keep()
        try:
            self._server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise ValueError(f"--peer-listen {self.address}: cannot listen there ({e})") from None
        await self._server.start()
        log.info("serving published sets to peers on %s", self.address)

    async def stop(self, grace: float) -> None:
        """Stop serving peers; streams in flight get `grace` seconds."""
        await self._server.stop(grace)
