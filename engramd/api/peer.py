"""The peer port (--peer-listen): operator-published sets handed to the fleet's other daemons.

PeerService.Fill over TCP, both ends authenticated by a challenge-response
over the fleet's shared token (sources/trust.py: this server proves it
first, the receiver then; the token never travels), the offer's digests
(checksums and strong digests) attested with the fleet's key. A set this
node loaded from its files gets its strong digests from its published
copy's pages on the first offer of that copy (on a thread of their own,
every core hashing), kept for later offers: a copy never changes once
published. A set this node filled is offered with the origin's strong
digests and attestation, kept in its manifest. Only sets the operator
published (loaded by --checkpoint or `engramd load`) are offered; a set
a worker's attach loaded stays owner-only and is answered as absent, like
any set not held. Each stream's copy is mapped read-only and registered by
a transfer process of that stream's own (Export: sources/xferproc.py says
why none runs in the daemon), for the stream's life; the receiver reads it,
a window at a time, each granted once the daemon's rate cap (--peer-rate,
all peers together) allows. The export is made on a pool thread, and the
reads are served by the transfer process's UCX: the worker socket's event
loop only hands out grants.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engramd.api.sockets import REQUEST_TIMEOUT_S, tcp_server
from engramd.errors import abort
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd.sources.base import WINDOW_BYTES, SourceFailed
from engramd.sources.nixlxfer import Agent, nixl_build, spare
from engramd.sources.regions import Region, close_all
from engramd.sources.strong import digest_views
from engramd.sources.trust import NONCE_BYTES, FleetKey, nonce, proven
from engramd.units import gib
from engramd_shared.errors import InvalidRequest, NotAllowed, UnknownSet
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")


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


class Export:
    """One stream's served copy: a transfer process of its own that maps only that copy,
    read-only, and has it registered with its NIXL agent for the stream's life."""

    def __init__(self, ts: TableSet, receiver: str) -> None:
        assert ts.manifest is not None
        self.copy = ts.copy
        opened = ts.backing.descriptors(ts.manifest)
        fds = dict(opened)
        try:
            self.agent = Agent({"UCX": {}}, peer=receiver, serves=True)
            try:
                tensors = ts.manifest.tensors
                addresses = self.agent.attach(
                    [(fds[t.file], t.offset, t.nbytes) for t in tensors], writable=False
                )
                self._addresses = addresses
                self._manifest = ts.manifest
                self._metadata = self.agent.metadata()
            except BaseException:
                self.agent.close()
                raise
        finally:
            for _, fd in opened:
                os.close(fd)

    def offer(self, attestation: str, strong: list[str]) -> peer_pb2.SetOffer:
        """The copy described for the receiver: manifest, strong digests, their attestation,
        where it lies."""
        return peer_pb2.SetOffer(
            manifest_json=self._manifest.to_json(),
            nixl_metadata=self._metadata,
            regions=[
                peer_pb2.RemoteRegion(address=a, nbytes=t.nbytes)
                for a, t in zip(self._addresses, self._manifest.tensors, strict=True)
            ],
            attestation=attestation,
            strong_digests=strong,
        )

    def ended(self) -> str:
        """Why the transfer process ended before the stream did ("" while it runs)."""
        return self.agent.ended()

    def close(self) -> None:
        """End the transfer process: nothing of the copy is reachable any more."""
        self.agent.close()


def receiver_address(peer: str) -> str:
    """The IP of a gRPC peer string ("ipv4:10.0.0.2:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest[1 : rest.index("]")]
    return rest.rpartition(":")[0]


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """Fill: offer a published set, then grant windows under the rate cap."""

    def __init__(self, store: SetStore, key: FleetKey, rate: int) -> None:
        self._store = store
        self._key = key
        self._cap = RateCap(rate)
        self._pool = BlockingPool("peer", 2)
        # One copy digested at a time, each on every core: an Export is never queued behind.
        self._digesting = BlockingPool("peer-digest", 1)
        #: The strong digests of each copy loaded from files, by (copy, its manifest's nonce):
        #: a published copy's bytes never change, and a copy loaded again has another nonce.
        self._strong: dict[tuple[str, str], asyncio.Future[list[str]]] = {}

    def _published(self, set_id: str) -> TableSet:
        ts = self._store.offered(set_id)
        if ts is None:
            # The same answer for a set not held and one only a worker's attach loaded.
            raise UnknownSet(f"this daemon serves no published set {set_id} to peers")
        return ts

    async def _attestation(self, ts: TableSet) -> tuple[str, list[str]]:
        """The attestation and strong digests a receiver checks the copy with: the origin's,
        kept in the manifest of a set this node filled (never signed again here), else this
        node's own of its copy's digests (it took them from its files)."""
        manifest = ts.manifest
        assert manifest is not None
        if manifest.attestation is not None:
            if manifest.strong_digests is None:
                # Filled by an engramd that attested checksums alone: nothing to forward.
                raise UnknownSet(
                    f"set {manifest.set_id} was filled by an older engramd that kept no strong "
                    "digests; it is not served to peers until it is dropped and loaded again"
                )
            return manifest.attestation, list(manifest.strong_digests)
        key = (ts.copy, manifest.nonce)
        digesting = self._strong.get(key)
        if digesting is None:
            # An earlier load of this copy is gone; its digests never count again.
            for old in [k for k in self._strong if k[0] == ts.copy]:
                del self._strong[old]
            digesting = asyncio.ensure_future(self._digest(ts))
            self._strong[key] = digesting

            def forget(done: asyncio.Future[list[str]]) -> None:
                # A failed digest (the copy dropped meanwhile) is tried again next time.
                if (done.cancelled() or done.exception()) and self._strong.get(key) is done:
                    del self._strong[key]

            digesting.add_done_callback(forget)
        # Shielded: a stream that ends while its copy is hashed leaves the digest to the next.
        strong = await asyncio.shield(digesting)
        attested = self._key.attest(manifest.set_id, manifest.fingerprint, manifest.tensors, strong)
        return attested, strong

    async def _digest(self, ts: TableSet) -> list[str]:
        started = time.monotonic()
        strong = await self._digesting.run(copy_strong_digests, ts)
        assert ts.manifest is not None
        log.info(
            "set %s: strong digests of its %s taken for peers in %.2f s",
            ts.copy,
            gib(ts.manifest.nbytes),
            time.monotonic() - started,
        )
        return strong

    async def Fill(
        self,
        request_iterator: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """One receiver's fill of one set: each side proves it holds the token, this one
        first; then the offer."""
        opening = _Opening()
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
                ts = self._published(set_id)
                attested, strong = await self._attestation(ts)
                export = await self._pool.run(opening.make, ts, receiver_address(context.peer()))
            except Exception as e:
                await abort(context, e)
                return
            log.info("peer %s: filling set %s", context.peer(), ts.copy)
            yield peer_pb2.FillReply(offer=export.offer(attested, strong))
            # What this stream may still be granted: the set's bytes, a window at a time.
            left = ts.nbytes
            async for request in requests:
                if request.WhichOneof("step") != "window":
                    break
                n = request.window
                if not 0 < n <= min(WINDOW_BYTES, left):
                    log.warning(
                        "peer %s: asked for a window of %d bytes with %d left; ended",
                        context.peer(),
                        n,
                        left,
                    )
                    await abort(
                        context,
                        InvalidRequest(
                            f"a window of {n} bytes: windows are 1 to {WINDOW_BYTES} bytes, "
                            f"and this fill has {left} bytes of set {ts.set_id} left to grant"
                        ),
                    )
                left -= n
                await self._cap.take(n)
                if ended := export.ended():
                    # A peer wrote into the read-only copy, or read outside it.
                    log.warning(
                        "peer %s: the transfer process serving set %s %s; fill ended",
                        context.peer(),
                        ts.copy,
                        ended,
                    )
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, f"the transfer process {ended}"
                    )
                yield peer_pb2.FillReply(granted=n)
        finally:
            # Not awaited: a stream the receiver cancelled may be cancelled again here.
            opening.end()


class _Opening:
    """The Export of one stream, made on a pool thread while the stream may end first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._export: Export | None = None
        self._ended = False

    def make(self, ts: TableSet, receiver: str) -> Export:
        """Export `ts` for `receiver`, unless the stream ended meanwhile."""
        export = Export(ts, receiver)
        with self._lock:
            if not self._ended:
                self._export = export
                return export
        export.close()
        raise InvalidRequest("the fill ended while its set was being exported")

    def end(self) -> None:
        """The stream ended: close its Export, now or once it is made."""
        with self._lock:
            self._ended = True
            export, self._export = self._export, None
        if export is not None:
            export.close()


def copy_strong_digests(ts: TableSet) -> list[str]:
    """Each tensor's strong digest, from the pages of the published copy `ts` (mapped
    read-only here while they are hashed).

    Raises UnknownSet when a tensor's bytes lost the checksum they were loaded
    with: a copy changed since is never attested (a receiver checks only the
    strong digests this node attests).
    """
    manifest = ts.manifest
    assert manifest is not None
    opened = ts.backing.descriptors(manifest)
    regions: list[Region] = []
    try:
        fds = dict(opened)
        for t in manifest.tensors:
            regions.append(Region(fds[t.file], t.offset, t.nbytes))
        got = digest_views([r.view() for r in regions], [t.checksum for t in manifest.tensors])
        for t, checksum in zip(manifest.tensors, got.checksums, strict=True):
            if checksum != t.checksum:
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
        return got.strong
    finally:
        close_all(regions)
        for _, fd in opened:
            os.close(fd)


class PeerServer:
    """The peer port: its own gRPC server on TCP, beside the worker and admin sockets."""

    def __init__(
        self, store: SetStore, address: str, key: FleetKey, rate: int, idle_timeout: float
    ) -> None:
        self.address = address
        # Anyone who reaches the port may call: the TCP ports' deadlines and caps.
        self._server = tcp_server(idle_timeout)
        self._service = PeerService(store, key, rate)
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
