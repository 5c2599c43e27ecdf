"""The daemon's lifecycle: claim the sockets, adopt and load sets, serve, stop.

`create_server(config)` builds everything without touching the process
(no signal handlers), so tests start real servers in-process or in a child;
`serve(config)` is what `engramd serve` runs: start, wait for SIGTERM/SIGINT,
stop gracefully.

Listeners, all on the one event loop:
  socket        TableService + Health Check (gRPC), 0660, group `socket_group`
  fd_socket     the fd channel (fdchannel.py): read-only descriptors, 0660, same group
  admin_socket  AdminService + Health (gRPC), 0600 (the daemon's owner)
  health_port   Health only (Check and Watch), TCP, when asked for (Kubernetes probes)
  metrics_port  Prometheus text over HTTP, when asked for
  peer_listen   PeerService (gRPC over TCP, peer.py): published sets to the fleet, when asked for
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engramd.api.admin import AdminService
from engramd.api.fdchannel import FdChannel
from engramd.api.peer import PeerServer, read_token
from engramd.api.service import TableService
from engramd.api.sockets import (
    REQUEST_TIMEOUT_S,
    HealthCheckOnly,
    RequestDeadline,
    claim_socket,
    group_id,
    raise_fd_limit,
    secure_socket,
    worker_socket_options,
)
from engramd.backings import backings_for
from engramd.config import DaemonConfig, admin_socket_for
from engramd.errors import DecodeGuard
from engramd.host.blocking import BlockingPool
from engramd.host.fdstore import FdStore
from engramd.host.sdnotify import Notifier
from engramd.sets.loader import LoadProgress
from engramd.sets.policy import resolve
from engramd.sets.store import SetStore
from engramd.sets.tableset import SetState, TableSet
from engramd.sources.chain import SourceChain
from engramd.sources.objstore import ObjectStoreSource
from engramd.sources.peer import PeerSource
from engramd.units import gib
from engramd_shared.errors import CheckpointError, ShareError
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("engramd")

SERVICE_NAME = "engramd.v1.TableService"
_MAX_UNIX_PATH = 107
#: How often systemd hears about load progress (STATUS=, EXTEND_TIMEOUT_USEC=).
NOTIFY_INTERVAL_S = 1.0
#: Start-up time each adopted set buys while it is verified (30 minutes).
VERIFY_EXTEND_USEC = 30 * 60 * 1_000_000


class EngramdServer:
    """One daemon: the gRPC servers, the set store and the background tasks."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.gid = group_id(config.socket_group)
        self.notifier = Notifier()
        #: Where loads' bytes come from before the files (peers, object store); None: the files.
        self.sources = _sources(config)
        self.store = SetStore(
            backings_for(config, self.gid, FdStore(self.notifier)),
            config.load_threads,
            config.mlock,
            memory_budget=config.memory_budget,
            evict_idle=config.evict_idle,
            adopt_grace_s=config.adopt_grace,
            max_leases=config.max_leases,
            placement=config.numa,
            leases_per_uid=config.leases_per_uid,
            worker_share_per_uid=config.worker_share_per_uid,
            fill=self.sources,
        )
        #: Every configured set is ready (health SERVING, systemd READY=1).
        self.ready = False
        self.service = TableService(config, self.store, lambda: self.ready, self.gid)
        self.health = health_aio.HealthServicer()
        self.fd_channel = FdChannel(
            config.fd_socket, self.gid, self.store, config.fd_connections_per_uid
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
            AdminService(config, self.store, self.service.status, self.service.prover), self.admin
        )
        self.probes: grpc.aio.Server | None = None
        if config.health_port:
            self.probes = grpc.aio.server(interceptors=[DecodeGuard()])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.probes)
        self.peers: PeerServer | None = None
        if config.peer_listen:
            self.peers = PeerServer(
                self.store, config.peer_listen, read_token(config.peer_token_file), config.peer_rate
            )
        self._configured: list[TableSet] = []
        self._readers = BlockingPool("config-checkpoint", 2)
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics: WSGIServer | None = None

    async def start(self) -> None:
        """Adopt what tmpfs holds, start the configured loads, bind and serve."""
        for path in self._sockets():
            claim_socket(path, self.gid)
        await self.store.adopt_existing(verify=self.config.verify, verifying=self._notify_verify)
        if self.sources is not None:
            # Before the configured loads: their fills then pay only for their bytes.
            await self._readers.run(self.sources.warm)
        for checkpoint in self.config.checkpoints:
            try:
                # Kept: the workers re-attaching after a restart name this checkpoint.
                plan = await self._readers.run(
                    self.service.plans.plan, resolve(checkpoint), self.config.tensors
                )
                copies = await self.store.ensure_everywhere(plan)
                for ts in copies:
                    if ts.manifest is not None:
                        # Adopted: perhaps loaded from a worker's copy under this id.
                        prover = self.service.prover
                        proof = await self._readers.run(prover.judge, plan, ts.manifest)
                        if proof.nbytes:
                            self._notify_verify(ts.set_id)
                        progress = LoadProgress(proof.nbytes)
                        await self._readers.run(prover.prove, proof, ts.manifest, progress)
                self.store.publish(copies)
                self._configured += copies
            except (CheckpointError, ShareError) as e:
                # The daemon keeps serving every other set; health stays
                # NOT_SERVING so the operator sees that this one is missing.
                log.error("cannot load configured checkpoint %s: %s", checkpoint, e)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.add_insecure_port(f"unix:{self.config.socket}")
        self.admin.add_insecure_port(f"unix:{self.config.admin_socket}")
        self.fd_channel.bind()
        await self.grpc.start()
        await self.admin.start()
        self.fd_channel.start()
        secure_socket(self.config.socket, 0o660, self.gid)
        secure_socket(self.config.fd_socket, 0o660, self.gid)
        secure_socket(self.config.admin_socket, 0o600, None)
        if self.probes is not None:
            address = f"{_host(self.config.health_address)}:{self.config.health_port}"
            self.probes.add_insecure_port(address)
            await self.probes.start()
            log.info("health checks on %s", address)
        if self.peers is not None:
            await self.peers.start()
        if self.config.metrics_port:
            # Imported only when asked for: prometheus_client and its HTTP server
            # are a tenth of the daemon's imports, paid on every restart.
            from engramd.api.metrics import serve_metrics

            self._metrics = serve_metrics(
                self.store,
                lambda: self.ready,
                self.config.metrics_address,
                self.config.metrics_port,
            )
            log.info(
                "metrics on http://%s:%d/metrics",
                _host(self.config.metrics_address),
                self.config.metrics_port,
            )
        log.info(
            "engramd serving on %s (fd channel %s, admin %s, backing %s, pid %d)",
            self.config.socket,
            self.config.fd_socket,
            self.config.admin_socket,
            ", ".join(f"{b.name} {b.usage().where}" for b in self.store.backings),
            os.getpid(),
        )
        if self.config.allow_writable_gpu_mappings:
            log.warning(
                "--allow-writable-gpu-mappings: workers whose GPU cannot register read-only "
                "memory get writable descriptors of tmpfs/hugetlbfs sets, and any of them could "
                "change the one copy every worker reads; `engramd verify` finds such writes"
            )
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_ready()), loop.create_task(self._sweep())]

    async def _watch_ready(self) -> None:
        while not all(ts.done.is_set() for ts in self._configured):
            self._notify_progress()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(ts.done.wait() for ts in self._configured)),
                    NOTIFY_INTERVAL_S,
                )
        if len(self._configured) < len(self.config.checkpoints) or any(
            ts.state is not SetState.READY for ts in self._configured
        ):
            log.error("not every configured set is ready; health stays NOT_SERVING")
            self.notifier.send(STATUS="not every configured set is ready; see the log")
            return
        self.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        held = sum(ts.nbytes for ts in self.store.sets.all() if ts.state is SetState.READY)
        self.notifier.send(
            READY=1, STATUS=f"serving {len(self.store.sets.all())} set(s), {gib(held)}"
        )
        log.info("ready: %d configured set(s) loaded", len(self._configured))

    def _notify_verify(self, set_id: str) -> None:
        # Verifying reads every byte of the set (minutes at 189 GiB): each set
        # buys its own time, so a large adoption outlives TimeoutStartSec.
        self.notifier.send(
            STATUS=f"verifying adopted set {set_id}", EXTEND_TIMEOUT_USEC=VERIFY_EXTEND_USEC
        )

    def _notify_progress(self) -> None:
        loading = [ts for ts in self._configured if ts.progress and not ts.done.is_set()]
        if not loading:
            return
        done = sum(ts.bytes_loaded for ts in loading)
        total = sum(ts.nbytes for ts in loading)
        elapsed = max(
            time.monotonic() - min(ts.progress.started for ts in loading if ts.progress), 1e-9
        )
        rate = done / elapsed
        eta = (total - done) / rate if rate else 0.0
        self.notifier.send(
            STATUS=f"loading {gib(done)} of {gib(total)} ({rate / 1e9:.2f} GB/s, ETA {eta:.0f} s)",
            # Each progress report buys time; a stalled load still times out.
            EXTEND_TIMEOUT_USEC=int(NOTIFY_INTERVAL_S * 30 * 1e6),
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            self.store.leases.sweep_dead()
            await self.store.drop_abandoned(self.config.worker_set_grace)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving: tell workers, finish RPCs, keep (or drop) the sets, free the sockets."""
        self.notifier.send(STOPPING=1, STATUS="stopping")
        await self.health.enter_graceful_shutdown()
        self.store.leases.drain()
        grace = self.config.grace if grace is None else grace
        servers = [s for s in (self.grpc, self.admin, self.probes, self.peers) if s is not None]
        await asyncio.gather(self.fd_channel.stop(), *(s.stop(grace) for s in servers))
        if self._metrics is not None:
            self._metrics.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close(drop=self.config.drop_on_exit, grace=grace)
        for path in self._sockets():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.notifier.close()
        kept = all(b.survives_restart for b in self.store.backings)
        log.info(
            "engramd stopped; sets %s",
            "dropped"
            if self.config.drop_on_exit
            else "kept for the next start"
            if kept
            else "freed once no worker maps them (memfd without an fd store)",
        )

    def _sockets(self) -> tuple[str, str, str]:
        return self.config.socket, self.config.fd_socket, self.config.admin_socket


def create_server(config: DaemonConfig) -> EngramdServer:
    """A daemon for `config`, not yet started: `await server.start()`, later `stop()`."""
    sockets = (
        config.socket,
        config.admin_socket or admin_socket_for(config.socket),
        config.fd_socket or str(Path(config.socket).with_name("fds.sock")),
    )
    for path in sockets:
        if len(path.encode()) > _MAX_UNIX_PATH:
            raise ValueError(
                f"socket path {path} is longer than {_MAX_UNIX_PATH} bytes, "
                "the limit of a Unix socket address; choose a shorter path"
            )
    return EngramdServer(
        replace(
            config,
            shm_dir=str(Path(config.shm_dir).resolve()),
            admin_socket=sockets[1],
            fd_socket=sockets[2],
        )
    )


def _sources(config: DaemonConfig) -> SourceChain | None:
    """Where loads' bytes come from before the files: the peers, then the object store."""
    if not config.peers and not config.object_store:
        return None
    peers = None
    if config.peers:
        token = read_token(config.peer_token_file)
        peers = PeerSource(config.peers, token, config.peer_min_rate)
    store = ObjectStoreSource(config.object_store) if config.object_store else None
    return SourceChain(peers, store)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


async def serve(config: DaemonConfig) -> None:
    """Run the daemon until SIGTERM or SIGINT, then stop gracefully."""
    raise_fd_limit()
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
