"""Prometheus metrics, computed at each scrape (`--metrics-port`), served on the event loop.

The port is plain HTTP that anyone who reaches it may connect to, so it is
served without a thread per connection (prometheus_client's server made one
for each): on the daemon's event loop, each connection has REQUEST_TIMEOUT_S
to send its request head (at most MAX_HEAD_BYTES), is answered once and
closed; at most TCP_CONNECTIONS are open, CONNECTIONS_PER_ADDRESS of one
address, and the rest are closed at once. A scrape reads the sets where they
live, on the loop, in a few milliseconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from engramd.api.sockets import REQUEST_TIMEOUT_S, TCP_CONNECTIONS
from engramd.api.wire import own_usage
from engramd.backings import Usage
from engramd.sets.fallbacks import FallbackBook
from engramd.sets.leases import LeaseBook
from engramd.sets.store import SetStore
from engramd.sets.tableset import SetState
from engramd.sets.warming import cached_bytes

#: The longest request head (request line and headers) read.
MAX_HEAD_BYTES = 8192
#: Connections one address holds at once: a scraper needs one.
CONNECTIONS_PER_ADDRESS = 8


@dataclass(frozen=True)
class SetSample:
    """One set at one scrape."""

    set_id: str
    #: The NUMA node of a per-node copy, "" for a set's one copy.
    node: str
    backing: str
    state: str
    nbytes: int
    leases: int
    locked: bool
    loaded: int
    #: Bytes per second of its load (done, or so far); None before any.
    rate: float | None
    #: Where its bytes came from ("files", "peer HOST:PORT", "s3://...", "adopted").
    source: str
    #: The bytes each of several sources gave its load (a fill from peers).
    by_source: dict[str, int]
    #: Bytes of a disk-backed set in the page cache; None for a set held in memory whole.
    cached: int | None
    #: The checkpoint it was loaded from (a folder, or s3://bucket/prefix).
    checkpoint: str
    #: Seconds since its oldest lease began (None: no lease).
    oldest_lease_s: float | None


def _sample(store: SetStore) -> tuple[list[SetSample], list[tuple[str, Usage]]]:
    now = time.monotonic()
    samples = []
    for ts in store.held():
        rate = None
        if ts.state is SetState.READY and ts.load_seconds:
            rate = ts.nbytes / ts.load_seconds
        elif ts.state is SetState.LOADING and ts.progress is not None:
            rate = ts.bytes_loaded / max(now - ts.progress.started, 1e-9)
        samples.append(
            SetSample(
                ts.set_id,
                "" if ts.node is None else str(ts.node),
                ts.backing.name,
                ts.state.value,
                ts.nbytes,
                LeaseBook.count(ts),
                ts.locked,
                ts.bytes_loaded,
                rate,
                ts.source,
                ts.bytes_by_source,
                cached_bytes(ts),
                ts.checkpoint,
                max((now - lease.started for lease in LeaseBook.listed(ts)), default=None),
            )
        )
    return samples, [(b.name, own_usage(store, b)) for b in store.backings]


class StoreCollector(Collector):
    """Reads the daemon's state on each scrape (on the event loop); nothing is updated on the
    hot path."""

    def __init__(
        self,
        store: SetStore,
        fallbacks: FallbackBook | None = None,
        configured: Callable[[], set[str]] | None = None,
    ) -> None:
        self._store = store
        self._stats = store.leases.stats
        self._fallbacks = fallbacks
        self._configured = configured or (lambda: set())
        self._started = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """One scrape's worth of metrics."""
        sets, usages = _sample(self._store)
        ready = self._store.ready
        yield from self._sets(sets)
        yield from self._moved()
        yield from self._replicas()
        yield from self._backings(usages)
        yield GaugeMetricFamily(
            "engramd_ready", "1 once every configured set is ready", 1 if ready else 0
        )
        yield GaugeMetricFamily(
            "engramd_start_time_seconds",
            "When this daemon started (seconds since the epoch): a restart moves it",
            self._started,
        )

    def _sets(self, sets: list[SetSample]) -> Iterator[GaugeMetricFamily]:
        configured = self._configured()
        copy = ["set_id", "node", "checkpoint"]
        set_bytes = GaugeMetricFamily(
            "engramd_set_bytes", "Bytes of a set's tensors", labels=[*copy, "backing", "state"]
        )
        leases = GaugeMetricFamily("engramd_set_leases", "Workers attached", labels=copy)
        locked = GaugeMetricFamily("engramd_set_locked", "1 when mlocked", labels=copy)
        loaded = GaugeMetricFamily("engramd_load_bytes_done", "Bytes copied in so far", labels=copy)
        rate = GaugeMetricFamily("engramd_load_bytes_per_second", "Load throughput", labels=copy)
        source = GaugeMetricFamily(
            "engramd_set_source",
            "1, labelled with where the set's bytes came from",
            labels=[*copy, "source"],
        )
        by_source = GaugeMetricFamily(
            "engramd_load_bytes_by_source",
            "Bytes each of several sources gave a load (a fill from peers)",
            labels=[*copy, "source"],
        )
        cached = GaugeMetricFamily(
            "engramd_set_cached_bytes",
            "Bytes of a disk-backed set in the page cache",
            labels=copy,
        )
        oldest = GaugeMetricFamily(
            "engramd_set_oldest_lease_seconds",
            "Seconds since the set's oldest lease began (sets with leases only)",
            labels=copy,
        )
        unconfigured = GaugeMetricFamily(
            "engramd_set_unconfigured",
            "1 for a set no configured checkpoint names (engramd drop frees it)",
            labels=copy,
        )
        for s in sets:
            key = [s.set_id, s.node, s.checkpoint]
            if s.cached is not None:
                cached.add_metric(key, s.cached)
            for name, n in s.by_source.items():
                by_source.add_metric([*key, name], n)
            set_bytes.add_metric([*key, s.backing, s.state], s.nbytes)
            leases.add_metric(key, s.leases)
            locked.add_metric(key, 1 if s.locked else 0)
            loaded.add_metric(key, s.loaded)
            if s.rate is not None:
                rate.add_metric(key, s.rate)
            if s.source:
                source.add_metric([*key, s.source], 1)
            if s.oldest_lease_s is not None:
                oldest.add_metric(key, s.oldest_lease_s)
            unconfigured.add_metric(key, 0 if s.set_id in configured else 1)
        yield from (set_bytes, leases, locked, loaded, rate, source, by_source, cached, oldest)
        yield unconfigured

    def _moved(self) -> Iterator[CounterMetricFamily]:
        received, served = self._stats.moved()
        by_source = CounterMetricFamily(
            "engramd_received_bytes",
            "Bytes finished loads took from each source (files, a peer HOST:PORT, s3://...)",
            labels=["source"],
        )
        for name, n in received.items():
            by_source.add_metric([name], n)
        yield by_source
        yield CounterMetricFamily(
            "engramd_peer_served_bytes", "Bytes granted to peer daemons' fills", served
        )

    def _replicas(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # Scanned first: a record new since the last sweep is counted in this scrape.
        found = self._fallbacks.scan() if self._fallbacks is not None else []
        attached, fell_back = self._stats.snapshot()
        attaches = CounterMetricFamily("engramd_attaches", "Attaches answered", labels=["result"])
        for result, count in attached.items():
            attaches.add_metric([result], count)
        yield attaches
        fallbacks = CounterMetricFamily(
            "engramd_fallbacks", "Fallbacks to private tables reported by workers", labels=["cause"]
        )
        for cause, count in fell_back.items():
            fallbacks.add_metric([cause], count)
        yield fallbacks
        replicas = GaugeMetricFamily(
            "engramd_fallback_replicas",
            "Replicas holding private tables now, by cause (their records beside the socket)",
            labels=["cause"],
        )
        private = GaugeMetricFamily(
            "engramd_fallback_bytes",
            "Bytes of private tables those replicas hold, by cause",
            labels=["cause"],
        )
        counts: collections.Counter[str] = collections.Counter()
        held: collections.Counter[str] = collections.Counter()
        for f in found:
            counts[f.cause] += 1
            held[f.cause] += max(f.record.nbytes, 0)
        for cause in counts:
            replicas.add_metric([cause], counts[cause])
            private.add_metric([cause], held[cause])
        yield from (replicas, private)

    def _backings(self, usages: list[tuple[str, Usage]]) -> Iterator[GaugeMetricFamily]:
        first = usages[0][1]
        for name, value in (("total", first.total), ("used", first.used), ("free", first.free)):
            yield GaugeMetricFamily(
                f"engramd_shm_{name}_bytes", f"first backing's {name} bytes", value
            )
        for name in ("total", "used", "free"):
            family = GaugeMetricFamily(
                f"engramd_backing_{name}_bytes", f"{name} bytes per backing", labels=["backing"]
            )
            for backing, usage in usages:
                family.add_metric([backing], getattr(usage, name))
            yield family


class MetricsServer:
    """/metrics over HTTP on the event loop; start() binds, stop() closes every connection."""

    def __init__(
        self,
        store: SetStore,
        address: str,
        port: int,
        fallbacks: FallbackBook | None = None,
        configured: Callable[[], set[str]] | None = None,
    ) -> None:
        self._address = address
        self._port = port
        self._registry = CollectorRegistry()
        self._registry.register(StoreCollector(store, fallbacks, configured))
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task[None]] = set()
        self._by_address: collections.Counter[str] = collections.Counter()

    async def start(self) -> None:
        """Bind and serve on the running loop."""
        self._server = await asyncio.start_server(
            self._connected, self._address, self._port, limit=MAX_HEAD_BYTES
        )

    async def stop(self) -> None:
        """Stop listening and end the connections in progress."""
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        task = asyncio.current_task()
        if (
            task is None
            or len(self._open) >= TCP_CONNECTIONS
            or self._by_address[address] >= CONNECTIONS_PER_ADDRESS
        ):
            writer.transport.abort()
            return
        self._open.add(task)
        self._by_address[address] += 1
        try:
            await self._answer(reader, writer)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client gone, silent or too long: its connection is closed below
        finally:
            try:
                # The reply's last bytes go out before the close; a client that reads
                # nothing has REQUEST_TIMEOUT_S to, then is cut off.
                writer.close()
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(writer.wait_closed(), REQUEST_TIMEOUT_S)
            finally:
                writer.transport.abort()
                self._open.discard(task)
                self._by_address[address] -= 1
                if not self._by_address[address]:
                    del self._by_address[address]

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        lines = head.decode("latin-1").split("\r\n")
        method, target, *_ = (*lines[0].split(" "), "", "")
        headers = dict(
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        )
        if method not in ("GET", "HEAD"):
            status, content_type, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
        elif target.partition("?")[0] not in ("/metrics", "/"):
            status, content_type, body = "404 Not Found", "text/plain", b"see /metrics\n"
        else:
            encode, content_type = choose_encoder(headers.get("accept", ""))
            status, body = "200 OK", encode(self._registry)
        writer.write(
            (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            + (body if method != "HEAD" else b"")
        )
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
