"""The daemon's life in three phases: start-up, serving, shutdown.

As uvicorn splits Config from Server: `create_server(config)` builds a
`Daemon` (the node's sets from engramd.sets, the listeners from engramd.api)
without touching the process (no signal handlers), so tests start real
daemons in-process or in a child; `serve(config)` is what `engramd serve`
runs: start up, wait for SIGTERM or SIGINT (the handlers only record it),
shut down.

  startup()   claim the sockets, adopt what the backings hold, start the
              configured loads, bind and serve (health NOT_SERVING); a task
              then waits for the configured sets: health SERVING, READY=1
  shutdown()  STOPPING=1, health NOT_SERVING, end every lease (workers hear
              the daemon is stopping), stop the listeners within the grace,
              keep (or drop) the sets, free the sockets

systemd hears about every phase (sd_notify): load progress and each adopted
set's verification buy start-up time (EXTEND_TIMEOUT_USEC).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engramd.api.server import Listeners
from engramd.api.sockets import check_socket_paths, group_id, raise_fd_limit
from engramd.backings import backings_for
from engramd.config import DaemonConfig, admin_socket_for
from engramd.errors import NotInSocketGroup
from engramd.host.fdstore import FdStore
from engramd.host.sdnotify import Notifier
from engramd.sets.keeper import SetKeeper
from engramd.sets.tableset import SetState
from engramd.units import gib
from engramd_shared.checkpoint import is_store_url

if TYPE_CHECKING:
    from engramd.fleet.node import Fleet

log = logging.getLogger("engramd")

#: How often systemd hears about load progress (STATUS=, EXTEND_TIMEOUT_USEC=).
NOTIFY_INTERVAL_S = 1.0
#: Start-up time each adopted set buys while it is verified (30 minutes).
VERIFY_EXTEND_USEC = 30 * 60 * 1_000_000


class Daemon:
    """One daemon: the node's sets, the listeners over them, and the background tasks."""

    def __init__(self, config: DaemonConfig) -> None:
        """Build the sets and the listeners for `config` (as create_server completes it)."""
        self.config = config
        gid = _socket_group(config)
        self.notifier = Notifier()
        fleet = _fleet(config)
        #: The node's sets: every verb that plans, loads, proves, publishes, leases or drops.
        self.sets = SetKeeper(
            config,
            backings_for(config, gid, FdStore(self.notifier)),
            fleet.remote if fleet is not None else None,
            gid,
        )
        #: The sets' store: readiness (`store.ready`), the sets and their leases.
        self.store = self.sets.store
        peers = fleet.listener(self.store) if fleet is not None else None
        self.listeners = Listeners(config, self.sets, gid, [] if peers is None else [peers])
        self._tasks: list[asyncio.Task[None]] = []

    async def startup(self) -> None:
        """Adopt what the backings hold, start the configured loads, bind and serve."""
        self.listeners.claim()
        await self.sets.load_configured(verifying=self._notify_verify)
        await self.listeners.start()
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

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop serving: tell workers, finish calls, keep (or drop) the sets, free the sockets."""
        self.notifier.send(STOPPING=1, STATUS="stopping")
        await self.listeners.draining()
        self.sets.leases.drain()
        grace = self.config.grace if grace is None else grace
        await self.listeners.stop(grace)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.sets.close(drop=self.config.drop_on_exit, grace=grace)
        for backing in self.store.backings:
            backing.release()
        self.listeners.unlink()
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

    async def _watch_ready(self) -> None:
        if not await self.store.settle(NOTIFY_INTERVAL_S, self._notify_progress):
            failed = self.sets.failed_configured()
            log.error("not every configured set is ready; health stays NOT_SERVING")
            # systemctl status shows this line: the checkpoint and why, not "see the log".
            why = "; ".join(f"{c}: {e}" for c, e in failed) or "see the log"
            self.notifier.send(STATUS=f"not ready: configured checkpoint not loaded: {why}")
            return
        await self.listeners.serving()
        held = sum(ts.nbytes for ts in self.store.held() if ts.state is SetState.READY)
        self.notifier.send(READY=1, STATUS=f"serving {len(self.store.held())} set(s), {gib(held)}")
        log.info("ready: %d configured set(s) loaded", len(self.store.configured))

    def _notify_verify(self, set_id: str) -> None:
        # Verifying reads every byte of the set (minutes at 189 GiB): each set
        # buys its own time, so a large adoption outlives TimeoutStartSec.
        self.notifier.send(
            STATUS=f"verifying adopted set {set_id}", EXTEND_TIMEOUT_USEC=VERIFY_EXTEND_USEC
        )

    def _notify_progress(self) -> None:
        loading = [ts for ts in self.store.configured if ts.progress and not ts.done.is_set()]
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
            await self.sets.sweep()


def _fleet(config: DaemonConfig) -> Fleet | None:
    """Peers and object stores, only where a fleet flag asks for them (--peers,
    --peer-listen, --peer-token-file, --object-store). Without one the fleet's code is never
    imported: about 0.1 s less between exec and a configured load's start."""
    if not (config.peers or config.peer_listen or config.peer_token_file or config.object_store):
        return None
    from engramd.fleet.node import Fleet

    return Fleet(config)


def create_server(config: DaemonConfig) -> Daemon:
    """A daemon for `config`, not yet started: `await daemon.startup()`, later `shutdown()`."""
    sockets = (
        config.socket,
        config.admin_socket or admin_socket_for(config.socket),
        config.fd_socket or str(Path(config.socket).with_name("fds.sock")),
    )
    check_socket_paths(
        dict(zip(("--socket", "--admin-socket", "--fd-socket"), sockets, strict=True))
    )
    _check_settings(config)
    return Daemon(
        replace(
            config,
            shm_dir=str(Path(config.shm_dir).resolve()),
            # Path handles name the files by it: a relative one would resolve in the worker.
            disk_dir=str(Path(config.disk_dir).resolve()),
            admin_socket=sockets[1],
            fd_socket=sockets[2],
        )
    )


def _check_settings(config: DaemonConfig) -> None:
    """Refuse settings that would be ignored without a word."""
    if config.page_size and config.backing.name not in ("memfd", "auto"):
        raise ValueError(
            f"--page-size applies to memfd sets only, and --backing {config.backing} makes none; "
            "for huge pages there use the huge tmpfs (the default) or a --shm-dir on hugetlbfs, "
            "or pass --backing memfd"
        )
    if config.backing.name == "disk" and config.numa.policy:
        raise ValueError(
            f"--numa {config.numa.policy} places the pages engramd allocates in memory; a "
            "--backing disk set's pages are the page cache's, placed as each reader faults "
            "them in, and one copy on the disk serves every node: leave --numa out, or use "
            "--backing tmpfs"
        )
    stored = [c for c in config.checkpoints if is_store_url(c)]
    if stored and not config.peer_token_file:
        raise ValueError(
            f"--checkpoint {stored[0]} has no files on this node: its set is filled from the "
            "peers and that store and trusted by the fleet's attested manifest, which needs "
            "--peer-token-file (the fleet's token)"
        )
    if config.evict_idle and not config.memory_budget:
        raise ValueError(
            "--evict-idle drops unleased sets to stay within --memory-budget, which is not set; "
            "give a budget (--memory-budget 200G) or leave --evict-idle out"
        )


def _socket_group(config: DaemonConfig) -> int | None:
    """The socket group's gid; a group named on purpose must exist (the default may not)."""
    default = DaemonConfig.__dataclass_fields__["socket_group"].default
    if config.socket_group and config.socket_group != default:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            raise NotInSocketGroup(
                f"--socket-group {config.socket_group}: no such group, so workers could not be "
                f"given the sockets and sets; create it (groupadd {config.socket_group}), name "
                "an existing group, or pass --socket-group '' to keep the daemon's own"
            ) from None
    return group_id(config.socket_group)


async def serve(config: DaemonConfig) -> None:
    """Run the daemon until SIGTERM or SIGINT, then shut down gracefully."""
    raise_fd_limit()
    daemon = create_server(config)
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def record(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, record, sig)
    await daemon.startup()
    await stop.wait()
    log.info("received %s; stopping", signal.Signals(received[0]).name)
    await daemon.shutdown()
