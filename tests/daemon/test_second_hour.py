"""An operator's second hour: the node's replicas in status, settings checked by type, messages
that name the side that failed and the fix, status columns, and the metrics dashboards read."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet_nodes import nixl_missing, ready_set, receiving, serving

from conftest import Daemon, Worker, as_user, mounted_tmpfs, wait_until
from engramd.config import flags
from engramd_client import plan_tables
from fleet_lab import UCX_TCP, Net, free_port
from helpers import engramd

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"


def folder_for(socket: str) -> Path:
    """Where workers that fall back leave their records: beside the daemon's socket."""
    return Path(socket).parent / "fallbacks"


def _wide(*args: str) -> subprocess.CompletedProcess[str]:
    """`engramd ARGS` with a wide terminal: typer's error box folds nothing."""
    return subprocess.run(
        [sys.executable, "-m", "engramd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )


def _status(d: Daemon) -> dict[str, Any]:
    result = engramd("status", "--socket", str(d.socket), "--json")
    assert result.returncode in (0, 2), result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text: str = r.read().decode()
    return text


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name{labels}` in a scrape (0 where absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


# -- 1. the node's replicas ----------------------------------------------------------------


def test_a_replica_that_falls_back_on_a_small_tmpfs_is_listed_and_counted(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    port = free_port()
    with mounted_tmpfs("8m") as small:
        d = daemons(
            "--allow-root",
            str(checkpoint.parent),
            "--metrics-port",
            str(port),
            shm=small,
        )
        w = Worker(checkpoint, d.socket, labels={"engine": "vllm", "tp_rank": "1"})
        workers.append(w)
        assert w.hello["mode"] == "private"
        plan = plan_tables(checkpoint)

        doc = _status(d)
        [f] = doc["fallbacks"]
        assert f["pid"] == w.proc.pid and f["pid_verified"] is True
        assert f["uid"] == os.getuid()
        assert f["cause"] == "capacity" and f["set_id"] == plan.set_id
        assert f["bytes"] == plan.nbytes and f["since_s"] >= 0
        assert "--shm-size" in f["reason"]
        text = engramd("status", "--socket", str(d.socket)).stdout
        assert "replicas that fell back to private tables" in text, text
        assert str(w.proc.pid) in text and "capacity" in text and "vllm" in text
        assert "tp 1" in text and "host memory held privately by 1 replica: 20" in text
        assert _sample(_metrics(port), "engramd_fallbacks_total", cause="capacity") == 1
        assert _sample(_metrics(port), "engramd_fallback_replicas", cause="capacity") == 1

        # Gone with its process: the record is removed, the count stays.
        w.kill()
        wait_until(lambda: not _status(d)["fallbacks"], 10, "the record to go")
        assert not list(folder_for(str(d.socket)).iterdir())
        assert _sample(_metrics(port), "engramd_fallbacks_total", cause="capacity") == 1
        assert d.stop() == 0


def test_a_replica_that_could_not_reach_the_daemon_is_counted_once_it_starts(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    port = free_port()
    d = daemons("--checkpoint", str(checkpoint), "--metrics-port", str(port))
    assert d.stop() == 0  # the folder stays, as /run/engramd does
    w = Worker(checkpoint, d.socket)
    workers.append(w)
    assert w.hello["mode"] == "private"
    d.start()
    [f] = _status(d)["fallbacks"]
    assert f["cause"] == "daemon-unavailable" and f["pid"] == w.proc.pid
    assert _sample(_metrics(port), "engramd_fallbacks_total", cause="daemon-unavailable") == 1
    # Closing the private tables ends the record.
    assert w.exit() == 0
    wait_until(lambda: not _status(d)["fallbacks"], 10, "the record to go")


def test_records_folder_takes_the_group_and_refuses_links(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    d = daemons()
    folder = folder_for(str(d.socket))
    assert oct(folder.stat().st_mode & 0o7777) == oct(0o3770)
    (folder / "x.json").symlink_to(tmp_path / "elsewhere")
    (folder / "big.json").write_bytes(b"{" + b" " * 10_000)
    assert _status(d)["fallbacks"] == []
    assert not (folder / "x.json").is_symlink()


def test_status_names_engine_ranks_and_since_of_attached_replicas(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    labels = {"engine": "sglang", "engine_version": "0.5.23", "tp_rank": "3", "dp_rank": "1"}
    workers.append(Worker(checkpoint, d.socket, labels=labels))
    text = engramd("status", "--socket", str(d.socket)).stdout
    assert "ENGINE" in text and "RANKS" in text and "SINCE" in text, text
    assert "sglang 0.5.23" in text and "dp 1, tp 3" in text, text


# -- 2. settings checked by their declared type ---------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("mlock = 0", "key 'mlock' in {path}: expected true or false, got 0 (an integer)"),
        ("mlock = 1", "expected true or false, got 1 (an integer)"),
        ("load_threads = 1.5", "key 'load_threads' in {path}: expected a whole number"),
        ("grace = true", "expected a number, got True (a boolean)"),
        ("socket = 7", "key 'socket' in {path}: expected text in quotes, got 7"),
        ("checkpoint = [1]", "expected text in quotes, or an array of them"),
        ("memory_budget = true", "expected a size: a number of bytes, or text with a unit"),
        ("log_json = 1", "key 'log_json' in {path}: expected true or false"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_refused_naming_file_key_and_type(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = tmp_path / "engramd.toml"
    path.write_text(line + "\n")
    run = _wide("serve", "--config", str(path))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "AttributeError" not in run.stderr, run.stderr
    assert expected.format(path=path) in run.stderr, run.stderr


def test_a_config_of_the_right_types_is_taken(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    path = tmp_path / "engramd.toml"
    path.write_text("mlock = false\nmemory_budget = 1073741824\ngrace = 2\nload_threads = 1\n")
    d = daemons("--config", str(path))
    assert _status(d)["daemon"]["ready"]


def test_a_toml_syntax_error_says_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "engramd.toml"
    path.write_text("mlock = false\nsocket = /run/engramd/engramd.sock\n")
    run = _wide("serve", "--config", str(path))
    assert run.returncode == 2
    assert "at line 2, column 10: 'socket = /run/engramd/engramd.sock'" in run.stderr, run.stderr
    assert "text in quotes" in run.stderr


# -- 3. messages that name the side and the fix ---------------------------------------------


@pytest.fixture
def outsider_and_group() -> Iterator[tuple[str, str]]:
    """A user and a group made for the test (random names), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    tag = secrets.token_hex(3)
    user, group = f"edo{tag}", f"edg{tag}"
    subprocess.run(["groupadd", "--system", group], check=True, capture_output=True)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", user], check=True, capture_output=True
    )
    try:
        yield user, group
    finally:
        subprocess.run(["userdel", "--force", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def test_status_as_a_user_outside_the_socket_group_names_the_group_and_the_fix(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, outsider_and_group: tuple[str, str]
) -> None:
    user, group = outsider_and_group
    sock_dir.chmod(0o755)
    d = Daemon(
        sock_dir / "run" / "d.sock", shm_dir, ["--socket-group", group], sock_dir / "log"
    ).start()
    try:
        command = [*as_user(user), "-m", "engramd", "status", "--socket", str(d.socket)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert run.returncode == 1
        assert f"permission denied on {d.socket}" in run.stderr, run.stderr
        assert f"not in the group `{group}`" in run.stderr
        assert f"usermod -aG {group} {user}" in run.stderr
        assert "failed to connect" not in run.stderr
    finally:
        d.stop()


def test_status_with_no_daemon_says_what_is_wrong_and_what_to_do(
    checkpoint: Path, daemons: Any, sock_dir: Path
) -> None:
    run = engramd("status", "--socket", str(sock_dir / "none.sock"))
    assert run.returncode == 1
    assert f"engramd is not running here (no socket at {sock_dir / 'none.sock'})" in run.stderr
    assert "systemctl start engramd" in run.stderr and "failed to connect" not in run.stderr
    d = daemons()
    d.proc.kill()  # its socket stays behind
    d.proc.wait()
    run = engramd("status", "--socket", str(d.socket))
    assert f"nothing listens on {d.socket}" in run.stderr, run.stderr
    assert "failed to connect" not in run.stderr


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")
def test_a_fill_whose_own_transfer_process_cannot_start_names_this_node(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """Under a plain `nsenter --net` the receiver's /sys is the host's: UCX finds only lo."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file)
    b.daemon = Daemon(
        b.sock_dir / "d.sock",
        b.shm_dir,
        [
            *("--checkpoint", str(checkpoint), "--peers", f"{net.ip_a}:7077"),
            *("--peer-token-file", str(token_file), "--no-huge-tmpfs"),
        ],
        b.sock_dir / "daemon.log",
        dict(UCX_TCP),
        ["nsenter", f"--net=/run/netns/{net.b}", sys.executable],
    ).start(wait="up")
    d = b.daemon
    wait_until(lambda: "from the files" in d.log or "ready" in d.log, 120, "the fill to end")
    assert "this node's transfer process could not start" in d.log, d.log
    assert "ip netns exec" in d.log and "UCX_NET_DEVICES" in d.log
    assert "offers the set" not in d.log, d.log


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")
def test_a_fill_from_a_peer_no_one_answers_for_names_the_network(
    checkpoint: Path, daemons: Any, token_file: Path
) -> None:
    port = free_port()
    d = daemons(
        *("--checkpoint", str(checkpoint), "--peers", f"127.0.0.1:{port}"),
        *("--peer-token-file", str(token_file)),
    )
    assert _status(d)["daemon"]["ready"]
    assert f"peer 127.0.0.1:{port}: UNAVAILABLE: the network: this node cannot reach" in d.log
    assert "--peer-listen" in d.log, d.log


def _metrics_in(netns: str, port: int) -> str:
    """A scrape of the metrics port a daemon in `netns` serves on its loopback."""
    scrape = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    run = subprocess.run(
        [*Net.run_in(netns), sys.executable, "-c", scrape],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")
def test_bytes_served_to_peers_and_received_by_source_are_counted(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    a, b = nodes("a"), nodes("b")
    port_a, port_b = free_port(), free_port()
    serving(a, checkpoint, net, token_file, "--metrics-port", str(port_a))
    rb = receiving(b, checkpoint, net, token_file, "--metrics-port", str(port_b))
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    served = _sample(_metrics_in(net.a, port_a), "engramd_peer_served_bytes_total")
    assert served >= s.bytes, served
    received = _metrics_in(net.b, port_b)
    peer = f"{net.ip_a}:7077"
    assert _sample(received, "engramd_received_bytes_total", source=peer) == s.bytes
    # The serving node loaded its own from the files.
    assert _sample(_metrics_in(net.a, port_a), "engramd_received_bytes_total", source="files") == (
        s.bytes
    )


def test_a_disk_folder_the_daemon_cannot_write_names_user_mode_and_fix(
    checkpoint: Path, sock_dir: Path, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the daemon as another user")
    sock_dir.chmod(0o755)
    folder = sock_dir / "tables"
    folder.mkdir(mode=0o755)
    (sock_dir / "n").mkdir(mode=0o750)
    os.chown(sock_dir / "n", 65534, 65534)
    run = subprocess.run(
        [
            *as_user("nobody"),
            "-m",
            "engramd",
            "serve",
            "--socket",
            str(sock_dir / "n" / "d.sock"),
            "--socket-group",
            "",
            "--backing",
            "disk",
            "--disk-dir",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    assert "nobody" in run.stderr and "0755" in run.stderr and "chown" in run.stderr, run.stderr


# -- 6. status columns --------------------------------------------------------------------


def test_used_counts_this_daemons_sets_not_another_daemons_beside_it(
    checkpoint: Path, sock_dir: Path
) -> None:
    with mounted_tmpfs("64m") as mount:
        started = []
        try:
            for name, args in (("a", ["--checkpoint", str(checkpoint)]), ("b", [])):
                (mount / name).mkdir()
                (sock_dir / name).mkdir()
                log = sock_dir / f"{name}.log"
                d = Daemon(sock_dir / name / "d.sock", mount / name, args, log)
                started.append(d.start())
            a, b = started
            [s] = _status(a)["sets"]
            assert _status(a)["backings"][0]["used_bytes"] == s["bytes"]
            # The file system holds a's set; b holds nothing.
            assert _status(b)["backings"][0]["used_bytes"] == 0
            assert _status(b)["shm"]["used_bytes"] == 0
            shown = engramd("status", "--socket", str(b.socket)).stdout
            assert re.search(r"tmpfs\s+\S+\s+0 B\s", shown), shown
        finally:
            for d in started:
                d.stop()


def test_a_set_no_configured_checkpoint_names_is_marked_with_the_drop_command(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = _status(d)["sets"]
    assert s["unconfigured"] is False
    assert d.stop() == 0
    d = daemons(shm=d.shm_dir)  # the same sets, configured no more
    [s] = _status(d)["sets"]
    assert s["unconfigured"] is True and s["adopted"] is True
    text = engramd("status", "--socket", str(d.socket)).stdout
    assert f"`engramd drop {s['set_id']}` frees it" in text, text
    assert "named by no configured --checkpoint" in text


# -- 7. dashboards and alerts -------------------------------------------------------------


def _named_metrics() -> set[str]:
    """Every engramd metric the alert rules and the dashboard's panels name."""
    rules = yaml.safe_load((MONITORING / "engramd-alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((MONITORING / "engramd-dashboard.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\bengramd_[a-z_]+", e)}


def test_the_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: `make test-tools` installs Debian's prometheus")
    run = subprocess.run(
        [promtool, "check", "rules", str(MONITORING / "engramd-alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 5 rules found" in run.stdout, run.stdout


def test_every_metric_the_rules_and_panels_name_is_exported(checkpoint: Path, daemons: Any) -> None:
    port = free_port()
    daemons("--checkpoint", str(checkpoint), "--metrics-port", str(port))
    exported = set()
    for line in _metrics(port).splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            exported |= {name, f"{name}_total"} if kind == "counter" else {name}
    named = _named_metrics()
    assert {"engramd_fallback_replicas", "engramd_set_bytes", "engramd_ready"} <= named
    assert named - exported == set()


def test_serve_help_at_80_columns_cuts_no_flag_or_variable() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "engramd", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert shown.returncode == 0, shown.stderr
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80, shown.stdout
    assert "…" not in shown.stdout
    words = set(re.findall(r"[\w-]+", shown.stdout))
    for flag in flags():
        assert flag.env in words and flag.option in words, flag
