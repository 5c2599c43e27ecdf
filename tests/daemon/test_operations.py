"""What operators use: sd_notify, health and metrics ports, config file, logs, admin CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from checksums import checksum_by_hand
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import Worker, wait_until
from engramd.config import admin_socket_for
from engramd.host.shmfs import mount_of
from engramd_client import plan_tables
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.errors import Reason
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import reason


def engramd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engramd", *args], capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    # gRPC may bind an IPv4 address as a v4-mapped IPv6 one: the same loopback.
    return [
        (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_sd_notify_ready_only_after_the_set(checkpoint: Path, daemons: Any, sock_dir: Path) -> None:
    # Play systemd: a datagram socket in NOTIFY_SOCKET collects what the daemon says.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(30)
    d = daemons(
        "--checkpoint", str(checkpoint), wait="up", env={"NOTIFY_SOCKET": str(sock_dir / "notify")}
    )
    messages: list[str] = []
    while not any("READY=1" in m for m in messages):
        messages.append(notify.recv(4096).decode())
        if "READY=1" in messages[-1]:
            # READY=1 is sent only after the set is ready, never before.
            assert [s.state for s in d.status().sets] == ["ready"]
            assert d.status().daemon.ready
    loading = [m for m in messages if m.startswith("STATUS=loading")]
    assert loading, messages
    assert "GB/s" in loading[0] and "ETA" in loading[0] and "EXTEND_TIMEOUT_USEC=" in loading[0]
    d.stop(signal.SIGTERM)
    assert "STOPPING=1" in notify.recv(4096).decode()
    notify.close()


def test_verifying_adopted_sets_extends_the_start_timeout(
    checkpoint: Path, daemons: Any, sock_dir: Path
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    d.stop()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(30)
    d.args.append("--verify")
    d.env["NOTIFY_SOCKET"] = str(sock_dir / "notify")
    d.start(wait="up")
    messages: list[str] = []
    while not any("READY=1" in m for m in messages):
        messages.append(notify.recv(4096).decode())
    notify.close()
    # Verifying reads every byte: systemd must hear it before TimeoutStartSec runs out.
    [verifying] = [m for m in messages if f"STATUS=verifying adopted set {s.set_id}" in m]
    assert "EXTEND_TIMEOUT_USEC=" in verifying
    assert messages.index(verifying) < len(messages) - 1


def test_health_port_is_tcp_on_loopback_and_says_not_serving(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json}")
    port = free_port()
    d = daemons("--checkpoint", str(broken), "--health-port", str(port), wait="up")
    assert tcp_listeners(d.pid) == [("127.0.0.1", port)]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # Only health is served over TCP; the tables stay on the Unix socket.
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.TableServiceStub(ch).Status(pb.StatusRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_no_tcp_unless_asked_and_serving_when_ready(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    assert tcp_listeners(d.pid) == []
    d.stop()
    port = free_port()
    d.args += ["--health-port", str(port)]
    d.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    port = free_port()
    d = daemons("--checkpoint", str(checkpoint), "--metrics-port", str(port))
    workers.append(Worker(checkpoint, d.socket))
    with d.channel() as ch:
        pb_grpc.TableServiceStub(ch).ReportFallback(
            pb.FallbackReport(cause="capacity", set_id="0" * 20, pid=1, bytes=5), timeout=5
        )
    [s] = d.status().sets
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    labels = f'checkpoint="{checkpoint}",node="",set_id="{s.set_id}"'
    assert samples[f'engramd_set_bytes{{backing="tmpfs",{labels},state="ready"}}'] == s.bytes
    assert samples[f"engramd_set_leases{{{labels}}}"] == 1
    assert samples[f"engramd_load_bytes_done{{{labels}}}"] == s.bytes
    assert samples[f"engramd_load_bytes_per_second{{{labels}}}"] > 0
    assert samples['engramd_attaches_total{result="ok"}'] == 1
    assert samples['engramd_fallbacks_total{cause="capacity"}'] == 1
    assert samples["engramd_shm_total_bytes"] >= samples["engramd_shm_used_bytes"] >= s.bytes
    assert samples["engramd_ready"] == 1


def test_config_file_with_flags_winning(checkpoint: Path, daemons: Any, tmp_path: Path) -> None:
    config = tmp_path / "engramd.toml"
    config.write_text(
        f'checkpoint = ["{checkpoint}"]\n'
        'tensors = "*engram.embed.weight"\n'
        'socket = "/nonexistent/flag/wins.sock"\n'
        "load-threads = 1\n"
        "mlock = false\n"
    )
    d = daemons("--config", str(config))  # DaemonProcess passes --socket and --shm-dir
    [s] = d.status().sets
    assert s.checkpoint == str(checkpoint) and s.tensors == 2  # weights only
    assert not s.locked


def test_config_file_with_an_unknown_key_fails(sock_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "engramd.toml"
    config.write_text("checkpionts = []\n")
    result = engramd("serve", "--config", str(config), "--socket", str(sock_dir / "x.sock"))
    assert result.returncode != 0
    assert "checkpionts" in result.stderr


def test_json_logs(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--log-json")
    lines = [json.loads(line) for line in d.log.splitlines()]
    assert any("ready" in line["msg"] for line in lines)
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)


def test_socket_permissions(daemons: Any) -> None:
    d = daemons()
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(d.socket.with_name("admin.sock")).st_mode) == 0o600


def test_status_watch_refreshes(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engramd",
            "status",
            "--watch",
            "--interval",
            "0.1",
            "--socket",
            str(d.socket),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    frames = 0
    for line in watch.stdout:
        frames += line.count("\033[2J")
        if frames == 3:
            break
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=30) == 0
    assert frames == 3


def test_the_cli_starts_no_thread_before_status_watch_masks_ctrl_c() -> None:
    # status --watch blocks SIGINT before it opens a channel, so every gRPC thread
    # inherits the mask. A thread some import started earlier (numpy's BLAS pool, say)
    # would not: Ctrl-C landing there becomes a KeyboardInterrupt at a random point.
    threads = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, engramd.cli.commands; print(len(os.listdir('/proc/self/task')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert threads.stdout.strip() == "1"


def test_load_verify_drop_from_the_cli(checkpoint: Path, daemons: Any) -> None:
    d = daemons()
    socket_args = ["--socket", str(d.socket)]
    loaded = engramd("load", str(checkpoint), *socket_args)
    assert loaded.returncode == 0, loaded.stderr
    assert "100%" in loaded.stderr and "GB/s" in loaded.stderr
    [s] = d.status().sets
    assert s.state == "ready" and s.set_id in loaded.stdout
    # Each manifest digest is of the checkpoint's own bytes, taken while copying.
    manifest = json.loads((sets_root(d.shm_dir) / s.set_id / "manifest.json").read_text())
    for entry, tensor in zip(plan_tables(checkpoint).tensors, manifest["tensors"], strict=True):
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            source = f.read(entry.nbytes)
        assert tensor["checksum"] == checksum_by_hand(source)

    ok = engramd("verify", s.set_id, *socket_args)
    assert ok.returncode == 0 and "all 4 tensors match" in ok.stdout
    # Flip one byte of one table in tmpfs (root may; workers cannot: 0640, read-only maps).
    victim = manifest["tensors"][1]
    with open(sets_root(d.shm_dir) / s.set_id / victim["file"], "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = engramd("verify", s.set_id, *socket_args)
    assert bad.returncode == 1
    assert bad.stdout.strip() == f"corrupted: {victim['name']}"

    dropped = engramd("drop", s.set_id, *socket_args)
    assert dropped.returncode == 0, dropped.stderr
    assert list(d.status().sets) == []
    assert not (sets_root(d.shm_dir) / s.set_id).exists()


def test_drop_refuses_a_leased_set_unless_forced(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    w = Worker(checkpoint, d.socket)
    workers.append(w)
    [s] = d.status().sets
    refused = engramd("drop", s.set_id, "--socket", str(d.socket))
    assert refused.returncode == 1 and str(w.proc.pid) in refused.stderr
    # A refused drop says so: nothing failed to load.
    admin = ClientConfig(socket=admin_socket_for(str(d.socket)))
    with open_channel(admin) as ch, pytest.raises(grpc.RpcError) as refusal:
        pb_grpc.AdminServiceStub(ch).Drop(pb.DropRequest(set_id=s.set_id), timeout=10)
    assert refusal.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(refusal.value) == Reason.DROP_REFUSED
    forced = engramd("drop", s.set_id, "--force", "--socket", str(d.socket))
    assert forced.returncode == 0 and "1 leases ended" in forced.stdout
    # The worker keeps reading its mapping after the files are gone.
    assert w.ask("digest")["digests"] == w.hello["digests"]
    wait_until(lambda: list(d.status().sets) == [], 5, "the set to go")


def test_a_shm_folder_on_disk_is_refused_unless_accepted(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path, sock_dir: Path
) -> None:
    on_disk = tmp_path / "shm"
    on_disk.mkdir()
    fstype = mount_of(on_disk)[0]
    if fstype in ("tmpfs", "hugetlbfs"):
        pytest.skip(f"pytest's temporary folder is on {fstype} here, not on a disk")
    with pytest.raises(RuntimeError, match="exited with 1") as refused:
        daemons("--checkpoint", str(checkpoint), shm=on_disk, wait="up")
    message = str(refused.value)
    assert f"is on {fstype}, not tmpfs or hugetlbfs" in message
    assert "--backing memfd" in message and "--allow-disk-backed-tables" in message
    assert not (on_disk / "engramd").exists(), "nothing is written before the refusal"

    d = daemons("--checkpoint", str(checkpoint), "--allow-disk-backed-tables", shm=on_disk)
    (backing,) = d.status().backings
    assert backing.where == f"{on_disk} (on {fstype}, a disk: --allow-disk-backed-tables)"
    w = Worker(checkpoint, d.socket)
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert "--allow-disk-backed-tables" in engramd("status", "--socket", str(d.socket)).stdout
