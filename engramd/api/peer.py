"""The peer port (--peer-listen): operator-published sets handed to the fleet's other daemons.

PeerService.Fill over TCP, both ends authenticated by a challenge-response
over the fleet's shared token (sources/trust.py: this server proves it
first, the receiver then; the token never travels), the offer's digests
attested with the fleet's key. Only sets the operator published (loaded by
--checkpoint or `engramd load`) are offered; a set a worker's attach loaded
stays owner-only and is answered as absent, like any set not held. The
offered copy is mapped read-only and registered with the serving NIXL agent
while a stream uses it; the receiver reads it, a window at a time, each
granted once the daemon's rate cap (--peer-rate, all peers together)
allows. Registration and mapping run on their own threads, and the reads
are served by NIXL's progress thread: the worker socket's event loop only
hands out grants.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engramd.backings import Backing
from engramd.errors import DecodeGuard, abort
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd.sources.base import SourceFailed
from engramd.sources.nixlxfer import Agent
from engramd.sources.regions import Region, close_all
from engramd.sources.trust import NONCE_BYTES, FleetKey, nonce, proven
from engramd_shared.errors import InvalidRequest, NotAllowed, UnknownSet
from engramd_shared.layout import Manifest
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")


class RateCap:
    """Grants bytes at most at `rate` per second, all streams together (0: at once)."""

    def __init__(self, rate: int) -> None:
        self._rate = rate
        self._free_at = 0.0

    async def take(self, n: int) -> None:
        """Wait until `n` more bytes may go."""
        if not self._rate:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self._free_at)
        self._free_at = start + n / self._rate
        if start > now:
            await asyncio.sleep(start - now)


class _Exported:
    """One copy's memory mapped read-only and registered, for as many streams as read it."""

    def __init__(self, agent: Agent, backing: Backing, manifest: Manifest) -> None:
        opened = backing.descriptors(manifest)
        fds = dict(opened)
        try:
            self.regions = [
                Region(fds[t.file], t.offset, t.nbytes, writable=False) for t in manifest.tensors
            ]
        finally:
            for _, fd in opened:
                os.close(fd)
        try:
            self.handle = agent.register(
                [(r.address, r.nbytes, 0, "") for r in self.regions if r.nbytes], "DRAM"
            )
        except BaseException:
            close_all(self.regions)
            raise
        self.users = 0


class Exporter:
    """The serving NIXL agent and the copies it has registered; one call at a time."""

    def __init__(self) -> None:
        self._agent: Agent | None = None
        self._held: dict[str, _Exported] = {}
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Make the serving agent now; raises SourceFailed (NIXL missing, UCX failing)."""
        with self._lock:
            if self._agent is None:
                self._agent = Agent("serve", ["UCX"])

    def offer(self, ts: TableSet) -> peer_pb2.SetOffer:
        """Register the copy (once for all its streams) and describe it for a receiver."""
        assert ts.manifest is not None
        with self._lock:
            if self._agent is None:
                self._agent = Agent("serve", ["UCX"])
            held = self._held.get(ts.copy)
            if held is None:
                held = self._held[ts.copy] = _Exported(self._agent, ts.backing, ts.manifest)
            held.users += 1
            return peer_pb2.SetOffer(
                manifest_json=ts.manifest.to_json(),
                nixl_metadata=self._agent.metadata(),
                regions=[
                    peer_pb2.RemoteRegion(address=r.address, nbytes=r.nbytes) for r in held.regions
                ],
            )

    def release(self, copy: str) -> None:
        """One stream of `copy` ended; the last one deregisters and unmaps it."""
        with self._lock:
            held = self._held.get(copy)
            if held is None:
                return
            held.users -= 1
            if held.users == 0 and self._agent is not None:
                del self._held[copy]
                self._agent.deregister(held.handle)
                close_all(held.regions)


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """Fill: offer a published set, then grant windows under the rate cap."""

    def __init__(self, store: SetStore, key: FleetKey, rate: int) -> None:
        self._store = store
        self._key = key
        self._cap = RateCap(rate)
        #: The serving NIXL agent and what it has registered.
        self.exporter = Exporter()
        self._pool = BlockingPool("peer", 2)

    def _published(self, set_id: str) -> TableSet:
        ts = self._store.offered(set_id)
        if ts is None:
            # The same answer for a set not held and one only a worker's attach loaded.
            raise UnknownSet(f"this daemon serves no published set {set_id} to peers")
        return ts

    async def Fill(
        self,
        request_iterator: AsyncIterator[peer_pb2.FillRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.FillReply]:
        """One receiver's fill of one set: each side proves it holds the token, this one
        first; then the offer."""
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
        second = await anext(requests, None)
        if second is None:
            # A receiver whose key our proof failed sends nothing more (the tokens differ).
            log.warning("peer %s left before proving it holds the fleet's token", context.peer())
            return
        try:
            if not proven(second.proof, self._key.client_proof(set_id, theirs, mine)):
                log.warning("peer %s: wrong token; refused", context.peer())
                raise NotAllowed("wrong peer token: give both daemons the fleet's token file")
            ts = self._published(set_id)
            attested = attestation(self._key, ts)
            offer = await self._pool.run(self.exporter.offer, ts)
            offer.attestation = attested
        except Exception as e:
            await abort(context, e)
            return
        log.info("peer %s: filling set %s", context.peer(), ts.copy)
        try:
            yield peer_pb2.FillReply(offer=offer)
            async for request in requests:
                if request.WhichOneof("step") != "window":
                    break
                await self._cap.take(request.window)
                yield peer_pb2.FillReply(granted=request.window)
        finally:
            await self._pool.run(self.exporter.release, ts.copy)


def attestation(key: FleetKey, ts: TableSet) -> str:
    """The attestation a receiver checks the copy's digests with: the origin's, kept in the
    manifest of a set this node filled (never signed again here), else this node's own
    (it took the digests from its files)."""
    manifest = ts.manifest
    assert manifest is not None
    if manifest.attestation is not None:
        return manifest.attestation
    return key.attest(manifest.set_id, manifest.fingerprint, manifest.tensors)


class PeerServer:
    """The peer port: its own gRPC server on TCP, beside the worker and admin sockets."""

    def __init__(self, store: SetStore, address: str, key: FleetKey, rate: int) -> None:
        self.address = address
        self._server = grpc.aio.server(interceptors=[DecodeGuard()])
        self._service = PeerService(store, key, rate)
        peer_pb2_grpc.add_PeerServiceServicer_to_server(self._service, self._server)

    async def start(self) -> None:
        """Start the serving agent, bind and serve; an address that cannot be bound, or NIXL
        that cannot start, is an error naming it."""
        try:
            await asyncio.to_thread(self._service.exporter.warm)
        except SourceFailed as e:
            raise ValueError(f"--peer-listen {self.address}: {e}") from None
        try:
            self._server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise ValueError(f"--peer-listen {self.address}: cannot listen there ({e})") from None
        await self._server.start()
        log.info("serving published sets to peers on %s", self.address)

    async def stop(self, grace: float) -> None:
        """Stop serving peers; streams in flight get `grace` seconds."""
        await self._server.stop(grace)
