"""Prometheus metrics, computed at each scrape (`--metrics-port`).

The scrape runs on the HTTP server's thread; the sets belong to the event
loop. So each scrape asks the loop for a snapshot, and the counters live in
a locked Stats object: the collector never reads state another thread is
changing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engramd.backings import Usage
from engramd.sets.leases import LeaseBook
from engramd.sets.store import SetStore
from engramd.sets.tableset import SetState

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

#: How long a scrape waits for the event loop.
SNAPSHOT_TIMEOUT_S = 5.0


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
            )
        )
    return samples, [(b.name, b.usage()) for b in store.backings]


class StoreCollector(Collector):
    """Reads the daemon's state on each scrape; nothing is updated on the hot path."""

    def __init__(self, store: SetStore, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._stats = store.leases.stats
        self._loop = loop

    async def _snapshot(self) -> tuple[list[SetSample], list[tuple[str, Usage]], bool]:
        return (*_sample(self._store), self._store.ready)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """One scrape's worth of metrics."""
        sets, usages, ready = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop).result(
            SNAPSHOT_TIMEOUT_S
        )
        copy = ["set_id", "node"]
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
        for s in sets:
            set_bytes.add_metric([s.set_id, s.node, s.backing, s.state], s.nbytes)
            leases.add_metric([s.set_id, s.node], s.leases)
            locked.add_metric([s.set_id, s.node], 1 if s.locked else 0)
            loaded.add_metric([s.set_id, s.node], s.loaded)
            if s.rate is not None:
                rate.add_metric([s.set_id, s.node], s.rate)
            if s.source:
                source.add_metric([s.set_id, s.node, s.source], 1)
        yield from (set_bytes, leases, locked, loaded, rate, source)
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
        yield GaugeMetricFamily(
            "engramd_ready", "1 once every configured set is ready", 1 if ready else 0
        )


def serve_metrics(store: SetStore, address: str, port: int) -> WSGIServer:
    """Serve /metrics on a thread; returns the server (shutdown() stops it).

    Call on the event loop: scrapes take their snapshots there.
    """
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, asyncio.get_running_loop()))
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
