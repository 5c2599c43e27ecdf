"""Prometheus metrics, computed from the store at each scrape (`--metrics-port`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .shmfs import usage
from .store import SetStore

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .service import TableService


class StoreCollector(Collector):
    """Reads the daemon's state on each scrape; nothing is updated on the hot path."""

    def __init__(self, store: SetStore, service: TableService) -> None:
        self._store = store
        self._service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """One scrape's worth of metrics."""
        # The scrape runs on the metrics thread; copy before iterating.
        sets = list(self._store.sets.values())
        now = time.monotonic()
        set_bytes = GaugeMetricFamily(
            "engramd_set_bytes", "Bytes of a set's tensors", labels=["set_id", "backing", "state"]
        )
        leases = GaugeMetricFamily("engramd_set_leases", "Workers attached", labels=["set_id"])
        locked = GaugeMetricFamily("engramd_set_locked", "1 when mlocked", labels=["set_id"])
        loaded = GaugeMetricFamily(
            "engramd_load_bytes_done", "Bytes copied into tmpfs so far", labels=["set_id"]
        )
        rate = GaugeMetricFamily(
            "engramd_load_bytes_per_second", "Load throughput", labels=["set_id"]
        )
        for ts in sets:
            set_bytes.add_metric([ts.set_id, "shm", ts.state], ts.nbytes)
            leases.add_metric([ts.set_id], len(ts.leases))
            locked.add_metric([ts.set_id], 1 if ts.locked else 0)
            loaded.add_metric([ts.set_id], ts.bytes_loaded)
            if ts.state == "ready" and ts.load_seconds:
                rate.add_metric([ts.set_id], ts.nbytes / ts.load_seconds)
            elif ts.progress is not None and ts.state == "loading":
                rate.add_metric([ts.set_id], ts.bytes_loaded / max(now - ts.progress.started, 1e-9))
        yield from (set_bytes, leases, locked, loaded, rate)
        attaches = CounterMetricFamily("engramd_attaches", "Attaches answered", labels=["result"])
        for result, count in self._store.attaches.items():
            attaches.add_metric([result], count)
        yield attaches
        fallbacks = CounterMetricFamily(
            "engramd_fallbacks", "Fallbacks to private tables reported by workers", labels=["cause"]
        )
        for cause, count in list(self._store.fallbacks.items()):
            fallbacks.add_metric([cause], count)
        yield fallbacks
        u = usage(self._store.shm_dir)
        for name, value in (("total", u.total), ("used", u.used), ("free", u.free)):
            yield GaugeMetricFamily(f"engramd_shm_{name}_bytes", f"shm folder {name} bytes", value)
        yield GaugeMetricFamily(
            "engramd_ready", "1 once every configured set is ready", 1 if self._service.ready else 0
        )


def serve_metrics(store: SetStore, service: TableService, address: str, port: int) -> WSGIServer:
    """Serve /metrics on a thread; returns the server (shutdown() stops it)."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, service))
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
