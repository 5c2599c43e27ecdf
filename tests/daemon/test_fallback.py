"""Without a daemon: auto falls back once with a warning, strict raises, off never asks."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from conftest import Worker
from engramd_client import DaemonUnavailable, ShareError, attach
from engramd_client import share as share_module


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees a process that has warned about nothing yet."""
    monkeypatch.setattr(share_module, "_warned", set())
    monkeypatch.delenv("ENGRAMD_SHARE", raising=False)
    monkeypatch.delenv("ENGRAMD_SOCKET", raising=False)


def test_auto_falls_back_with_one_warning(
    checkpoint: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = sock_dir / "missing.sock"
    caplog.set_level(logging.WARNING, logger="engramd_client")
    start = time.monotonic()
    first = attach(checkpoint, socket=str(missing))
    elapsed = time.monotonic() - start
    second = attach(checkpoint, socket=str(missing))
    assert first.mode == second.mode == "private"
    assert first.reason is not None and str(missing) in first.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert str(missing) in warnings[0].getMessage()
    assert "ENGRAMD_SOCKET" in warnings[0].getMessage()
    # Reading 21 MB privately is part of it; the daemon check itself is instant.
    assert elapsed < 5, elapsed


def test_refused_socket_costs_under_a_second(checkpoint: Path, sock_dir: Path) -> None:
    # A socket file whose listener is gone: connect is refused at once.
    path = sock_dir / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="nothing listens"):
        attach(checkpoint, socket=str(path), share=True)
    assert time.monotonic() - start < 1.0


def test_silent_listener_costs_under_three_seconds(checkpoint: Path, sock_dir: Path) -> None:
    # Something accepts connections but never speaks gRPC (a hung daemon).
    path = sock_dir / "hung.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable) as info:
        attach(checkpoint, socket=str(path), share=True)
    # gRPC's own connect timeout or the client's reply timeout, whichever fires first.
    assert "hung.sock" in str(info.value) or "did not answer" in str(info.value)
    # Bounded by ClientConfig.reply_timeout_s: a live daemon answers within it
    # even under an attach storm on two cores.
    assert time.monotonic() - start < 3.0
    server.close()


def test_strict_raises(checkpoint: Path, sock_dir: Path) -> None:
    with pytest.raises(ShareError) as info:
        attach(checkpoint, socket=str(sock_dir / "missing.sock"), share=True)
    assert isinstance(info.value, DaemonUnavailable)
    assert "missing.sock" in str(info.value)


def test_env_selects_strict(
    checkpoint: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGRAMD_SHARE", "on")
    monkeypatch.setenv("ENGRAMD_SOCKET", str(sock_dir / "missing.sock"))
    with pytest.raises(DaemonUnavailable):
        attach(checkpoint)


def test_off_never_contacts_the_daemon(checkpoint: Path, sock_dir: Path) -> None:
    path = sock_dir / "watch.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    server.setblocking(False)
    tables = attach(checkpoint, socket=str(path), share=False)
    assert tables.mode == "private" and tables.reason is None
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody connected
    # The same listener does see auto mode connect (it then times out: no gRPC here).
    assert attach(checkpoint, socket=str(path)).mode == "private"
    conn, _ = server.accept()
    conn.close()
    server.close()


def test_fallback_in_a_worker_process_warns_once(
    checkpoint: Path, sock_dir: Path, workers: list[Worker]
) -> None:
    w = Worker(checkpoint, sock_dir / "missing.sock")
    workers.append(w)
    assert w.hello["mode"] == "private"
    assert w.exit() == 0
    stderr = w.stderr()
    assert stderr.count("WARNING") == 1, stderr
    assert "missing.sock" in stderr
