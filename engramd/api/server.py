"""The daemon's listeners over the node's sets: gRPC servers, the fd channel, probes, metrics.

All on the one event loop:
  socket        TableService + Health Check (gRPC), 0660, group `socket_group`
  fd_socket     the fd channel (fdchannel.py): read-only descriptors, 0660, same group
  admin_socket  AdminService + Health (gRPC), 0600 (the daemon's owner)
  health_port   Health Check only, TCP, when asked for (Kubernetes probes)
  metrics_port  Prometheus text over HTTP (metrics.py), when asked for
  others        what the lifecycle adds: the fleet's peer service (engramd/fleet), when asked for

The TCP ports have the worker socket's defences and caps of their own
(sockets.tcp_server; the metrics port's in metrics.py).

The daemon's lifecycle (engramd/lifecycle.py) builds them, starts them
once the configured sets are loading, and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engramd.api.admin import AdminService
from engramd.api.fdchannel import FdChannel
from engramd.api.service import TableService
from engramd.api.sockets import (
    REQUEST_TIMEOUT_S,
    HealthCheckOnly,
    RequestDeadline,
    claim_records_folder,
    claim_socket,
    secure_socket,
    tcp_server,
    worker_socket_options,
)
from engramd.config import DaemonConfig
from engramd.errors import DecodeGuard
from engramd.sets.keeper import SetKeeper
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from engramd.api.metrics import MetricsServer

log = logging.getLogger("engramd")

SERVICE_NAME = "engramd.v1.TableService"


class Listener(Protocol):
    """A server the lifecycle adds beside the daemon's own (the fleet's peer service)."""

    async def start(self) -> None:
        """Bind and serve; ValueError naming the flag where it cannot."""

    async def stop(self, grace: float) -> None:
        """Stop; calls in flight get `grace` seconds."""


class Listeners:
    """Every listener of one daemon, serving `sets`; bound by start(), closed by stop()."""

    def __init__(
        self,
        config: DaemonConfig,
        sets: SetKeeper,
        gid: int | None,
        others: Sequence[Listener] = (),
    ) -> None:
        """Build the servers; nothing is bound yet. `gid`: the socket group's (None: none);
        `others`: servers started after the daemon's own and stopped with them."""
        self._config = config
        self._gid = gid
        self._store = sets.store
        self._sets = sets
        self.service = TableService(config, sets)
        self.health = health_aio.HealthServicer()
        self.fd_channel = FdChannel(
            config.fd_socket, gid, sets.leases, config.fd_connections_per_uid
        )
        self.grpc = grpc.aio.server(
            interceptors=[
                RequestDeadline(min(REQUEST_TIMEOUT_S, config.idle_timeout)),
                DecodeGuard(),
            ],
            options=worker_socket_options(config),
        )
        pb_grpc.add_TableServiceServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(HealthCheckOnly(self.health), self.grpc)
        self.admin = grpc.aio.server(interceptors=[DecodeGuard()])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.admin)
        pb_grpc.add_AdminServiceServicer_to_server(
            AdminService(sets, self.service.status), self.admin
        )
        self.probes: grpc.aio.Server | None = None
        if config.health_port:
            self.probes = tcp_server(config.idle_timeout)
            health_pb2_grpc.add_HealthServicer_to_server(HealthCheckOnly(self.health), self.probes)
        self._others = list(others)
        self._metrics: MetricsServer | None = None

    def sockets(self) -> tuple[str, str, str]:
        """The worker socket, the fd channel's and the admin socket."""
        return self._config.socket, self._config.fd_socket, self._config.admin_socket

    def claim(self) -> None:
        """Take the sockets' paths: refuse when another daemon serves there, else clear them."""
        for path in self.sockets():
            claim_socket(path, self._gid)
        claim_records_folder(self._config.socket, self._gid)

    async def start(self) -> None:
        """Bind and serve, health NOT_SERVING until `serving()`."""
        config = self._config
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.add_insecure_port(f"unix:{config.socket}")
        self.admin.add_insecure_port(f"unix:{config.admin_socket}")
        self.fd_channel.bind()
        await self.grpc.start()
        await self.admin.start()
        self.fd_channel.start()
        secure_socket(config.socket, 0o660, self._gid)
        secure_socket(config.fd_socket, 0o660, self._gid)
        secure_socket(config.admin_socket, 0o600, None)
        if self.probes is not None:
            address = f"{host(config.health_address)}:{config.health_port}"
            self.probes.add_insecure_port(address)
            await self.probes.start()
            log.info("health checks on %s", address)
        for other in self._others:
            await other.start()
        if config.metrics_port:
            # Imported only when asked for: prometheus_client and its HTTP server
            # are a tenth of the daemon's imports, paid on every restart.
            from engramd.api.metrics import MetricsServer

            self._metrics = MetricsServer(
                self._store,
                config.metrics_address,
                config.metrics_port,
                self._sets.fallbacks,
                self._sets.configured_ids,
            )
            await self._metrics.start()
            log.info(
                "metrics on http://%s:%d/metrics",
                host(config.metrics_address),
                config.metrics_port,
            )

    async def serving(self) -> None:
        """Health SERVING: every configured set is ready."""
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        """Health NOT_SERVING for good: the daemon is stopping."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        """Stop every listener; calls in flight get `grace` seconds. The sockets stay (unlink)."""
        servers = [s for s in (self.grpc, self.admin, self.probes, *self._others) if s is not None]
        await asyncio.gather(self.fd_channel.stop(), *(s.stop(grace) for s in servers))
        if self._metrics is not None:
            await self._metrics.stop()

    def unlink(self) -> None:
        """Remove the sockets' paths."""
        for path in self.sockets():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


def host(address: str) -> str:
    """An address as a URL's host: an IPv6 address in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
