"""Leases end with their worker; a restarted daemon adopts its sets; workers reconnect."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from conftest import Daemon, Worker, wait_until
from engramd_shared.layout import sets_root


def lease_pids(d: Any) -> set[int]:
    return {lease.pid for s in d.status().sets for lease in s.leases}


def test_killed_worker_loses_its_lease_within_2s(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    keeper, victim = Worker(checkpoint, d.socket), Worker(checkpoint, d.socket)
    workers += [keeper, victim]
    assert lease_pids(d) == {keeper.proc.pid, victim.proc.pid}
    victim.kill()
    took = wait_until(lambda: lease_pids(d) == {keeper.proc.pid}, 2.0, "the lease to end")
    assert took < 2.0


def test_closed_tables_end_the_lease(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    w = Worker(checkpoint, d.socket)
    workers.append(w)
    assert lease_pids(d) == {w.proc.pid}
    w.ask("exit")
    wait_until(lambda: lease_pids(d) == set(), 2.0, "the lease to end")


def test_restart_adopts_and_workers_reattach(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [before] = d.status().sets
    assert not before.adopted
    w = Worker(checkpoint, d.socket, labels={"dp_rank": "0"})
    workers.append(w)
    first_lease = w.hello["lease_id"]
    set_folder = sets_root(d.shm_dir) / before.set_id
    inode = set_folder.stat().st_ino

    assert d.stop(signal.SIGTERM) == 0
    assert not d.socket.exists(), "the socket file outlived the daemon"
    assert set_folder.is_dir(), "the set was not kept in tmpfs"
    # The worker keeps reading the right bytes while no daemon runs.
    assert w.ask("digest")["digests"] == w.hello["digests"]

    d.start()
    [after] = d.status().sets
    assert after.adopted and after.state == "ready"
    assert after.set_id == before.set_id
    assert set_folder.stat().st_ino == inode, "the set was reloaded, not adopted"
    assert "adopted set" in d.log
    wait_until(lambda: lease_pids(d) == {w.proc.pid}, 10.0, "the worker's lease to come back")
    [lease] = d.status().sets[0].leases
    assert lease.labels["dp_rank"] == "0"
    assert w.ask("lease")["lease_id"] == lease.lease_id != first_lease
    assert w.ask("digest")["digests"] == w.hello["digests"]


def test_partial_loads_are_removed_at_start(checkpoint: Path, daemons: Any, shm_dir: Path) -> None:
    root = sets_root(shm_dir)
    root.mkdir()
    leftover = root / "0123456789abcdef0123.loading-1-deadbeef"
    leftover.mkdir()
    (leftover / "0000.bin").write_bytes(b"\0" * 4096)
    broken = root / "fedcba9876543210fedc"  # no manifest: never published whole
    broken.mkdir()
    d = daemons()
    assert not leftover.exists() and not broken.exists()
    assert d.status().sets == []


def test_drop_on_exit_removes_the_sets(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--drop-on-exit")
    [s] = d.status().sets
    assert (sets_root(d.shm_dir) / s.set_id).is_dir()
    assert d.stop() == 0
    assert not (sets_root(d.shm_dir) / s.set_id).exists()


def test_second_daemon_on_the_same_socket_refuses(checkpoint: Path, daemons: Any) -> None:
    d = daemons()
    # The socket answers (the first daemon), so start() returns at once.
    second = Daemon(d.socket, d.shm_dir, [], d.log_path.with_name("second.log")).start(wait="up")
    assert second.proc is not None and second.proc.wait(timeout=30) == 1
    assert "another engramd is serving" in second.log
    assert d.status().daemon.pid == d.proc.pid
