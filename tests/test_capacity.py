"""A tmpfs too small for the set, as under Docker's default 64 MiB /dev/shm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import Daemon, Worker, mounted_tmpfs
from engramd_client import plan_tables
from engramd_client.pb import engramd_pb2 as pb
from engramd_client.pb import engramd_pb2_grpc as pb_grpc
from helpers import reason


@pytest.fixture
def small_shm() -> Iterator[Path]:
    """A real 8 MiB tmpfs, as small as Docker's default /dev/shm is for big tables."""
    with mounted_tmpfs("8m") as path:
        yield path


def test_small_tmpfs_refuses_and_keeps_serving(
    checkpoint: Path, small_shm: Path, sock_dir: Path, workers: list[Worker]
) -> None:
    d = Daemon(
        sock_dir / "d.sock",
        small_shm,
        ["--allow-root", str(checkpoint.parent)],
        sock_dir / "daemon.log",
    )
    d.start()
    try:
        plan = plan_tables(checkpoint)
        with d.channel() as ch:
            call = pb_grpc.TableServiceStub(ch).Attach(
                pb.AttachRequest(set_id=plan.set_id, checkpoint=str(checkpoint), pid=1)
            )
            with pytest.raises(grpc.RpcError) as info:
                next(iter(call))
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason(err) == "capacity"
        assert "--shm-size" in str(err.details()) and "--ipc=host" in str(err.details())
        assert "8.00 MiB" in str(err.details()), str(err.details())

        auto = Worker(checkpoint, d.socket)
        workers.append(auto)
        assert auto.hello["mode"] == "private"
        assert "--shm-size" in auto.hello["reason"] and "--ipc=host" in auto.hello["reason"]

        strict = Worker(checkpoint, d.socket, share="on")
        workers.append(strict)
        assert strict.hello["error"] == "ShmCapacityError"

        status = d.status()  # still serving
        assert status.sets == [] or all(s.state != "ready" for s in status.sets)
        assert [p.name for p in small_shm.rglob("*") if p.is_file()] == []
    finally:
        assert d.stop() == 0
    assert [p for p in small_shm.rglob("*") if p.is_file()] == []


def test_daemon_reports_the_refusal_in_its_log(
    checkpoint: Path, small_shm: Path, sock_dir: Path
) -> None:
    d = Daemon(
        sock_dir / "d.sock", small_shm, ["--checkpoint", str(checkpoint)], sock_dir / "daemon.log"
    )
    d.start(wait="up")
    try:
        assert not d.status().daemon.ready
        assert "holds 8.00 MiB in all" in d.log
    finally:
        assert d.stop() == 0
