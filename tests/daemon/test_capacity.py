"""A tmpfs too small for the set, as under Docker's default 64 MiB /dev/shm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import Worker, mounted_tmpfs
from engramd_client import plan_tables
from engramd_shared.layout import LOCK_NAME
from engramd_shared.pb import engramd_pb2 as pb
from helpers import attach_error, reason


@pytest.fixture
def small_shm() -> Iterator[Path]:
    """A real 8 MiB tmpfs, as small as Docker's default /dev/shm is for big tables."""
    with mounted_tmpfs("8m") as path:
        yield path


def made(shm: Path) -> list[str]:
    """The files in `shm` but the daemon's lock file (one daemon per shm folder)."""
    return [p.name for p in shm.rglob("*") if p.is_file() and p.name != LOCK_NAME]


def test_small_tmpfs_refuses_and_keeps_serving(
    checkpoint: Path, small_shm: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--allow-root", str(checkpoint.parent), shm=small_shm)
    try:
        plan = plan_tables(checkpoint)
        err = attach_error(d, pb.AttachRequest(set_id=plan.set_id, checkpoint=str(checkpoint)))
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
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

        # Refused before anything was made: no set, not even a failed one, no file.
        assert d.status().sets == []
        assert made(small_shm) == []
    finally:
        assert d.stop() == 0
    assert made(small_shm) == []


def test_configured_set_too_large_keeps_the_daemon_not_ready(
    checkpoint: Path, small_shm: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint), wait="up", shm=small_shm)
    status = d.status()
    assert not status.daemon.ready and status.sets == []
    with d.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # The operator learns why, with the sizes and the fix.
    assert "holds 8.00 MiB in all" in d.log and "--shm-size" in d.log
    assert d.stop() == 0
