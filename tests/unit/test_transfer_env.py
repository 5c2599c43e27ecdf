"""What a transfer process's UCX is given at its start (nixlxfer.transfer_env)."""

from __future__ import annotations

import pytest

from engramd.sources.nixlxfer import TCP_SEGMENTS, transfer_env


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
