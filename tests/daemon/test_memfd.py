"""The memfd backing: sealed sets bounded by memory, not by /dev/shm; kept by an fd store."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from fdstore_harness import FdStoreHarness

from conftest import Worker, mounted_tmpfs, wait_until
from engramd.backings.memfd import SEALS
from engramd.cli.status_view import render
from engramd.testing.synth import SynthSpec, synthesize
from engramd_client import plan_tables
from engramd_shared.pb import engramd_pb2 as pb
from helpers import (
    attach_error,
    memfd_mappings,
    memory_cgroup,
    reason,
    reference_digests,
    shmem_bytes,
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 MiB of tables: far more than the 32 MiB shm folder of the test."""
    return synthesize(tmp_path_factory.mktemp("big") / "engram", SynthSpec(rows=508_500))


def test_memfd_serves_a_set_larger_than_the_shm_folder(
    big_checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    with mounted_tmpfs("32m") as shm:
        before = shmem_bytes()
        d = daemons("--backing", "memfd", "--checkpoint", str(big_checkpoint), shm=shm)
        [s] = d.status().sets
        assert s.backing == "memfd" and s.bytes >= 256 << 20
        expected = reference_digests(big_checkpoint)
        for _ in range(3):
            w = Worker(big_checkpoint, d.socket, share="on")
            workers.append(w)
            assert w.hello["mode"] == "shared" and w.hello["digests"] == expected
        grown = shmem_bytes() - before
        assert 0.95 * s.bytes <= grown <= 1.05 * s.bytes, f"Shmem grew {grown} for {s.bytes}"
        assert list(shm.iterdir()) == []  # the small shm folder is not even touched

        pid = workers[0].proc.pid
        ranges = memfd_mappings(pid)
        assert ranges, "the worker maps no engramd memfd"
        for mapping in ranges:
            path = f"/proc/{pid}/map_files/{mapping}"
            fd = os.open(path, os.O_RDONLY)
            try:
                assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
            finally:
                os.close(fd)
            # Root opens the very memory the worker maps for writing: the seals refuse.
            fd = os.open(path, os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(fd, b"\0" * 8, 0)
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        assert all(w.ask("digest")["digests"] == expected for w in workers)
        d.stop()


def test_auto_puts_a_set_in_tmpfs_when_it_fits_else_in_memfd(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path
) -> None:
    small = synthesize(tmp_path / "small", SynthSpec(rows=4_000, seed=3))
    large = checkpoint.parent / "large"
    large.symlink_to(checkpoint, target_is_directory=True)
    with mounted_tmpfs("8m") as shm:
        d = daemons(
            "--backing",
            "auto",
            "--allow-root",
            str(tmp_path),
            "--allow-root",
            str(checkpoint.parent),
            shm=shm,
        )
        for ckpt in (small, checkpoint):
            w = Worker(ckpt, d.socket, share="on")
            workers.append(w)
            assert w.hello["mode"] == "shared" and w.hello["digests"] == reference_digests(ckpt)
        status = d.status()
        assert {s.checkpoint: s.backing for s in status.sets} == {
            str(small): "tmpfs",  # 1 MB fits the 8 MiB folder
            str(checkpoint): "memfd",  # 21 MB does not
        }
        assert [b.name for b in status.backings] == ["tmpfs", "memfd"]
        assert status.backings[0].where == str(shm) and status.backings[0].survives_restart
        d.stop()
    large.unlink()


def test_memfd_capacity_is_the_cgroup_limit_and_the_error_names_it(
    big_checkpoint: Path, daemons: Any
) -> None:
    with memory_cgroup(192 << 20) as (python, limit):
        d = daemons("--backing", "memfd", "--allow-root", str(big_checkpoint.parent), python=python)
        try:
            plan = plan_tables(big_checkpoint)
            request = pb.AttachRequest(
                set_id=plan.set_id, checkpoint=str(big_checkpoint), accept=[pb.HANDLE_KIND_FD]
            )
            err = attach_error(d, request)
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason(err) == "capacity"
            assert limit in str(err.details()) and "MemoryMax=" in str(err.details())
            assert d.status().sets == []  # refused before a byte was copied
        finally:
            d.stop()  # the cgroup can go only once it is empty


def test_memfd_set_outlives_a_killed_daemon_through_the_fd_store(
    checkpoint: Path, daemons: Any, workers: list[Worker], sock_dir: Path
) -> None:
    expected = reference_digests(checkpoint)
    args = ("--backing", "memfd", "--checkpoint", str(checkpoint))
    with FdStoreHarness(sock_dir) as store:
        d = daemons(*args, env=store.env())
        [s] = d.status().sets
        names = {f"{s.set_id}.tables", f"{s.set_id}.manifest"}
        wait_until(lambda: store.names == names, 10, "the set in the fd store")
        assert d.status().backings[0].survives_restart
        workers += [Worker(checkpoint, d.socket, share="on") for _ in range(2)]
        d.stop(signal.SIGKILL)
        for w in workers:
            assert w.ask("digest")["digests"] == expected  # the mapping outlives the daemon
        python, fds = store.launcher()
        again = daemons(*args, env=store.env(), python=python, pass_fds=fds)
        [s] = again.status().sets
        assert s.adopted and s.state == "ready"
        assert again.log.count("loading set") == 1, "the next daemon loaded the set again"
        wait_until(lambda: again.status().sets[0].lease_count == 2, 10, "both leases back")
        assert not any(lease.stale for lease in again.status().sets[0].leases)
        assert store.names == names
        for w in workers:
            assert w.ask("lease")["stale"] is False
            assert w.ask("digest")["digests"] == expected
        # Dropped: out of the store too, so the next start does not get it back.
        assert (
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "engramd",
                    "drop",
                    s.set_id,
                    "--force",
                    "--socket",
                    str(again.socket),
                ],
                capture_output=True,
            ).returncode
            == 0
        )
        wait_until(lambda: store.names == set(), 10, "the set out of the fd store")


def test_memfd_without_a_store_reloads_and_workers_keep_their_copy(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    expected = reference_digests(checkpoint)
    d = daemons("--backing", "memfd", "--checkpoint", str(checkpoint))
    assert not d.status().backings[0].survives_restart
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    d.stop(signal.SIGKILL)
    assert w.ask("digest")["digests"] == expected
    d.start()
    [s] = d.status().sets
    assert not s.adopted and d.log.count("loading set") == 2
    wait_until(lambda: d.status().sets[0].lease_count == 1, 10, "the lease back")
    # The worker still reads its first copy, which the new daemon does not hold: stale.
    assert d.status().sets[0].leases[0].stale and w.ask("lease")["stale"] is True
    assert w.ask("digest")["digests"] == expected
    text = render(d.status())
    assert "do not survive a daemon restart" in text and "STALE" in text
    fresh = w.ask("refresh")
    assert fresh["stale"] is False
