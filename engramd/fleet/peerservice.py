"""The peer port (--peer-listen): operator-published sets handed to the fleet's other daemons,
and the verified pieces of those this node is filling from them.

PeerService.Fill over TCP, both ends authenticated by a challenge-response
over the fleet's shared token (fleet/trust.py: this server proves it
first, the receiver then; the token never travels), the offer's digests
(checksums and strong digests) attested with the fleet's key (served.py:
what is offered and its digests). A set this node is filling from peers is
offered with what its origin offered, and only its pieces verified here are
granted (fleet/filling.py); its receivers are told as more are. Only sets the
operator published (loaded by --checkpoint or `engramd load`) are offered; a
set a worker's attach loaded stays owner-only and is answered as absent, like
any set not held. A copy is mapped read-only and registered by a transfer
process of its own (Export: fleet/xferproc.py says why none runs in the
daemon), shared by the streams that read it over one network interface and
ended with the last of them (exports.py); the receiver reads it, a piece at a
time, each granted once the daemon's rate cap (--peer-rate, all peers
together) and the serving slots allow (grants.py). This module translates:
the stream's messages to those objects' calls and back. The export is made
on a pool thread, and the reads are served by the transfer process's UCX:
the worker socket's event loop only hands out grants.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engramd.api.sockets import REQUEST_TIMEOUT_S, tcp_server
from engramd.errors import abort
from engramd.fleet.base import WINDOW_BYTES, SourceFailed
from engramd.fleet.exports import Export, Exports, Opening
from engramd.fleet.filling import FillingSets
from engramd.fleet.grants import RateCap, Slots
from engramd.fleet.nixlxfer import TransferFailed, nixl_build, spare
from engramd.fleet.served import Offers, Served
from engramd.fleet.trust import NONCE_BYTES, FleetKey, nonce, proven
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.units import gib
from engramd_shared.errors import InvalidRequest, NotAllowed
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")

#: Seconds between two looks at a filling set's pieces, to tell a stream's receiver of new ones.
HOLDING_EVERY_S = 0.05


def receiver_address(peer: str) -> str:
    """The IP of a gRPC peer string ("ipv4:10.0.0.2:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest[1 : rest.index("]")]
    return rest.rpartition(":")[0]


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """Fill: offer a published set (or the verified pieces of one being filled), then grant
    pieces under the rate cap."""

    def __init__(self, store: SetStore, key: FleetKey, rate: int, filling: FillingSets) -> None:
        self._store = store
        self._key = key
        self._cap = RateCap(rate)
        self._slots = Slots()
        self._offers = Offers(store, key, filling)
        self._exports = Exports()
        self._pool = BlockingPool("peer", 2)

    async def Fill(
        self,
        request_iterator: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """One receiver's fill of one set: each side proves it holds the token, this one
        first; then the offer, then a grant for each piece asked for."""
        # Read once while the call is alive: gRPC's core frees the peer's address with the
        # transport, and context.peer() on a call the receiver cancelled reads freed memory
        # (a daemon killed by SIGSEGV in the fleet test; grpc/grpc#29927, never merged).
        receiver = context.peer()
        opening = Opening(self._exports)
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
                log.warning("peer %s left before proving it holds the fleet's token", receiver)
                return
            try:
                if not proven(second.proof, self._key.client_proof(set_id, theirs, mine)):
                    log.warning("peer %s: wrong token; refused", receiver)
                    raise NotAllowed("wrong peer token: give both daemons the fleet's token file")
                served = await self._offers.served(set_id)
                export = await self._pool.run(opening.make, served, receiver_address(receiver))
            except TransferFailed as e:
                # This node's side, not the receiver's: said so, with where the fix is.
                log.warning("peer %s: %s", receiver, e)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the serving peer's own transfer process failed ({e}); the fix is on "
                    "that node (its log names it)",
                )
                return
            except Exception as e:
                await abort(context, e)
                return
            log.info("peer %s: filling set %s", receiver, served.name)
            yield peer_pb2.FillReply(
                offer=export.offer(served.manifest_json, served.offered, served.held())
            )
            started, granted = time.monotonic(), 0
            try:
                async for reply in self._grants(served, export, requests, context, receiver):
                    step = reply.WhichOneof("step")
                    if step == "piece":
                        granted += served.pieces[reply.piece]
                    elif step == "granted":
                        granted += reply.granted
                    yield reply
            finally:
                _log_served(receiver, served, granted, time.monotonic() - started)
        finally:
            # Not awaited: a stream the receiver cancelled may be cancelled again here.
            opening.end()

    async def _grants(
        self,
        served: Served,
        export: Export,
        requests: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        receiver: str,
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """A grant for each piece (or window) asked for, and news of the pieces held."""
        with self._slots.stream() as outstanding:
            async for reply in self._answers(
                served, export, requests, context, receiver, outstanding
            ):
                yield reply

    async def _answers(
        self,
        served: Served,
        export: Export,
        requests: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        receiver: str,
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
                        receiver,
                        served,
                        f"a window of {n} bytes: windows are 1 to {WINDOW_BYTES} bytes, and "
                        f"this fill has {windows} bytes of set {served.name} left to grant",
                    )
                windows -= n
                await self._grant(n, export, served, context, receiver)
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
                    receiver,
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
            if p in outstanding or self._slots.busy():
                yield peer_pb2.FillReply(busy=p)
                continue
            left -= served.pieces[p]
            # The slot is held while the grant waits for the rate cap, and from the grant on.
            loop = asyncio.get_running_loop()
            outstanding[p] = loop.time()
            await self._grant(served.pieces[p], export, served, context, receiver)
            outstanding[p] = loop.time()
            yield peer_pb2.FillReply(piece=p)

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], receiver: str, served: Served, why: str
    ) -> None:
        log.warning("peer %s: %s; ended", receiver, why)
        await abort(context, InvalidRequest(why))

    async def _grant(
        self,
        n: int,
        export: Export,
        served: Served,
        context: grpc.aio.ServicerContext[Any, Any],
        receiver: str,
    ) -> None:
        """Wait for `n` bytes of the rate cap; end the stream if its transfer process died."""
        await self._cap.take(n)
        self._store.leases.stats.served(n)
        if ended := export.ended():
            # A peer wrote into the read-only copy, or read outside it.
            log.warning(
                "peer %s: the transfer process serving set %s %s; fill ended",
                receiver,
                served.name,
                ended,
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the transfer process {ended}")


def _log_served(receiver: str, served: Served, granted: int, seconds: float) -> None:
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
