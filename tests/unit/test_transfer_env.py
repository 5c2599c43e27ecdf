"""What a transfer process is given at its start (nixlxfer.start_env) and its UCX for a fill
(nixlxfer.transfer_env)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engramd.fleet import nixlxfer
from engramd.fleet.nixlxfer import TCP_SEGMENTS, start_env, transfer_env


def test_a_peer_fill_gets_the_device_and_the_tcp_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TCP_SEGMENTS:
        monkeypatch.delenv(name, raising=False)
    env = transfer_env("veth0")
    assert env == {"UCX_NET_DEVICES": "veth0", **TCP_SEGMENTS}


def test_an_operators_segment_size_is_kept_and_none_is_added(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    # The operator's own variable reaches the process with the rest of its UCX_ ones.
    assert transfer_env("veth0") == {"UCX_NET_DEVICES": "veth0"}


def test_an_object_store_process_gets_its_aws_variables_and_no_ucx_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    env = transfer_env("", ("AWS_",))
    assert env["AWS_REGION"] == "us-east-1"
    assert not any(k.startswith("UCX_") for k in env)


def test_a_transfer_process_starts_without_memory_events_only_where_no_rdma_device_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("UCX_MEM_EVENTS", raising=False)
    monkeypatch.setenv("ENGRAMD_PEER_TOKEN", "never passed")
    devices = tmp_path / "infiniband"
    monkeypatch.setattr(nixlxfer, "RDMA_DEVICES", devices)
    env = start_env()
    assert env["UCX_MEM_EVENTS"] == "no" and env["OPENBLAS_NUM_THREADS"] == "1"
    assert "ENGRAMD_PEER_TOKEN" not in env
    devices.mkdir()
    assert start_env()["UCX_MEM_EVENTS"] == "no"
    # An RDMA device: UCX's memory events keep its registration cache true.
    (devices / "mlx5_0").mkdir()
    assert "UCX_MEM_EVENTS" not in start_env()
    (devices / "mlx5_0").rmdir()
    # The operator's own setting wins either way.
    monkeypatch.setenv("UCX_MEM_EVENTS", "yes")
    assert start_env()["UCX_MEM_EVENTS"] == "yes"
