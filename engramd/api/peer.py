"""The peer port (--peer-listen): operator-published sets handed to the fleet's other daemons.

PeerService.Fill over TCP, authenticated by the fleet's shared token
(constant-time compare). Only sets the operator published (loaded by
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
import hmac
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engramd.api.sockets import tcp_server
from engramd.backings import Backing
from engramd.errors import abort
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd.sources.base import WINDOW_BYTES, SourceFailed
from engramd.sources.nixlxfer import Agent
from engramd.sources.regions import Region, close_all
from engramd_shared.errors import InvalidRequest, NotAllowed, UnknownSet
from engramd_shared.layout import Manifest
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")


def read_token(path: str) -> str:
    """The fleet's token from its file (a Secret's key); refuses an empty or missing one."""
    if not path:
        raise ValueError(
            "--peer-listen and --peers need --peer-token-file: a file holding the fleet's "
            "shared token (a Kubernetes Secret)"
        )
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"--peer-token-file {path}: {e.strerror}") from None
    if len(token) < 16:
        raise ValueError(
            f"--peer-token-file {path} holds {len(token)} characters; use at least 16 "
            "(e.g. `openssl rand -hex 32`)"
        )
    return token


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

    def __init__(self, store: SetStore, token: str, rate: int) -> None:
        self._store = store
        self._token = token.encode()
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
        """One receiver's fill of one set."""
        first = await anext(aiter(request_iterator), None)
        try:
            if first is None or first.WhichOneof("step") != "open":
                raise InvalidRequest("a fill opens with FillOpen (token, set id)")
            if not hmac.compare_digest(first.open.token.encode(), self._token):
                log.warning("peer %s: wrong token; refused", context.peer())
                raise NotAllowed("wrong peer token: give both daemons the fleet's token file")
            ts = self._published(first.open.set_id)
            offer = await self._pool.run(self.exporter.offer, ts)
        except Exception as e:
            await abort(context, e)
            return
        log.info("peer %s: filling set %s", context.peer(), ts.copy)
        try:
            yield peer_pb2.FillReply(offer=offer)
            # What this stream may still be granted: the set's bytes, a window at a time.
            left = ts.nbytes
            async for request in request_iterator:
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
                yield peer_pb2.FillReply(granted=n)
        finally:
            await self._pool.run(self.exporter.release, ts.copy)


class PeerServer:
    """The peer port: its own gRPC server on TCP, beside the worker and admin sockets."""

    def __init__(
        self, store: SetStore, address: str, token: str, rate: int, idle_timeout: float
    ) -> None:
        self.address = address
        # Anyone who reaches the port may call: the TCP ports' deadlines and caps.
        self._server = tcp_server(idle_timeout)
        self._service = PeerService(store, token, rate)
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
