"""The daemon's lifecycle: claim the socket, adopt and load sets, serve, stop.

`create_server(config)` builds everything without touching the process
(no signal handlers), so tests start real servers in-process or in a child;
`serve(config)` is what `engramd serve` runs: start, wait for SIGTERM/SIGINT,
stop gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engramd_client.checkpoint import CheckpointError, plan_tables
from engramd_client.pb import engramd_pb2_grpc as pb_grpc

from .config import DaemonConfig
from .errors import ServiceError
from .service import TableService
from .store import SetStore, TableSet

log = logging.getLogger("engramd")

SERVICE_NAME = "engramd.v1.TableService"
_MAX_UNIX_PATH = 107


class EngramdServer:
    """One daemon: the gRPC server, the set store and the background tasks."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.store = SetStore(config.shm_dir, config.load_threads, config.mlock)
        self.service = TableService(config, self.store)
        self.health = health_aio.HealthServicer()
        self.grpc = grpc.aio.server()
        pb_grpc.add_TableServiceServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self._configured: list[TableSet] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Adopt what tmpfs holds, start the configured loads, bind and serve."""
        _claim_socket(self.config.socket)
        Path(self.config.shm_dir).mkdir(parents=True, exist_ok=True)
        self.store.adopt_existing()
        for checkpoint in self.config.checkpoints:
            try:
                plan = await asyncio.to_thread(plan_tables, checkpoint, self.config.tensors)
                self._configured.append(self.store.ensure(plan))
            except (CheckpointError, ServiceError) as e:
                # The daemon keeps serving every other set; health stays
                # NOT_SERVING so the operator sees that this one is missing.
                log.error("cannot load configured checkpoint %s: %s", checkpoint, e)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.add_insecure_port(f"unix:{self.config.socket}")
        await self.grpc.start()
        os.chmod(self.config.socket, 0o660)
        log.info(
            "engramd serving on %s (shm folder %s, pid %d)",
            self.config.socket,
            self.config.shm_dir,
            os.getpid(),
        )
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_ready()), loop.create_task(self._sweep())]

    async def _watch_ready(self) -> None:
        for ts in self._configured:
            await ts.done.wait()
        if len(self._configured) < len(self.config.checkpoints) or any(
            ts.state != "ready" for ts in self._configured
        ):
            log.error("not every configured set is ready; health stays NOT_SERVING")
            return
        self.service.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: %d configured set(s) loaded", len(self._configured))

    async def wait_ready(self) -> bool:
        """Wait until every configured set finished loading; True when all are ready."""
        await self._tasks[0]
        return self.service.ready

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.store.sweep_dead()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving: tell workers, finish RPCs, keep (or drop) the sets, free the socket."""
        await self.health.enter_graceful_shutdown()
        self.store.drain()
        await self.grpc.stop(self.config.grace_s if grace is None else grace)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close(drop=self.config.drop_on_exit)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.socket)
        log.info(
            "engramd stopped; sets %s",
            "dropped" if self.config.drop_on_exit else "kept in tmpfs for the next start",
        )


def create_server(config: DaemonConfig) -> EngramdServer:
    """A daemon for `config`, not yet started: `await server.start()`, later `stop()`."""
    if len(config.socket.encode()) > _MAX_UNIX_PATH:
        raise ValueError(
            f"socket path {config.socket} is longer than {_MAX_UNIX_PATH} bytes, "
            "the limit of a Unix socket address; choose a shorter path"
        )
    return EngramdServer(replace(config, shm_dir=str(Path(config.shm_dir).resolve())))


def _claim_socket(path: str) -> None:
    """Make the socket's folder and remove a stale socket; refuse if a daemon answers there."""
    folder = Path(path).parent
    if not folder.exists():
        folder.mkdir(mode=0o750, parents=True)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno != errno.ECONNREFUSED:
            raise
        log.info("removing stale socket %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another engramd is serving on {path}; stop it first or choose --socket")


async def serve(config: DaemonConfig) -> None:
    """Run the daemon until SIGTERM or SIGINT, then stop gracefully."""
    server = create_server(config)
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def record(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, record, sig)
    await server.start()
    await stop.wait()
    log.info("received %s; stopping", signal.Signals(received[0]).name)
    await server.stop()
