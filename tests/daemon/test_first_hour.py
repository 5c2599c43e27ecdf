"""An operator's first hour: mistakes refused at start, failures shown where operators look.

Each test makes the mistake a new operator would (a second daemon on one shm
folder, colliding sockets, a broken configured checkpoint, a client command
pointed at the daemon's config file) or meets the failure they would (a set
whose bytes changed) against real daemons, and asserts the message that
names the setting and the fix.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import Daemon, Worker, as_user, mounted_hugetlbfs, wait_until
from engramd.host.hugeroot import unmount_below
from engramd_shared.errors import Reason
from engramd_shared.layout import LOCK_NAME, sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import attach_error, engramd, reason, reference_digests


def _exit_code(d: Daemon) -> int:
    """Start `d`, which should stop by itself; its exit code (it is killed if it serves)."""
    d.start(wait="no")
    assert d.proc is not None
    try:
        return d.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        d.stop(signal.SIGKILL)
        raise AssertionError(f"the daemon kept running:\n{d.log}") from None


def test_a_second_daemon_on_one_shm_folder_refuses_and_touches_nothing(
    checkpoint: Path, daemons: Any, workers: list[Worker], sock_dir: Path, shm_dir: Path
) -> None:
    first = daemons("--checkpoint", str(checkpoint))
    [held] = first.status().sets
    files = sorted(p.name for p in (sets_root(shm_dir) / held.set_id).iterdir())
    # The mistake: another --socket, the same --shm-dir, and it would drop what it adopted.
    (sock_dir / "b").mkdir(mode=0o750)
    second = Daemon(sock_dir / "b" / "d.sock", shm_dir, ["--drop-on-exit"], sock_dir / "second.log")
    assert _exit_code(second) == 1
    log = second.log
    assert f"pid {first.pid}, socket {first.socket}" in log, log
    assert "one daemon per shm folder" in log and "--shm-dir" in log, log
    assert "adopted" not in log and "Traceback" not in log, log
    # Nothing of the first's was touched: its set, its files, new workers share it.
    assert sorted(p.name for p in (sets_root(shm_dir) / held.set_id).iterdir()) == files
    assert [s.state for s in first.status().sets] == ["ready"]
    w = Worker(checkpoint, first.socket)
    workers.append(w)
    assert w.hello["mode"] == "shared", w.hello
    w.exit()
    # The lock dies with its daemon: the next one on the folder adopts the set.
    assert first.stop() == 0
    third = daemons(shm=shm_dir)
    [adopted] = third.status().sets
    assert adopted.set_id == held.set_id and adopted.adopted
    assert (sets_root(shm_dir) / LOCK_NAME).exists()


def _refused(sock_dir: Path, shm_dir: Path, *args: str) -> str:
    """`engramd serve ARGS` that must stop at start: its one error line."""
    result = engramd("serve", "--shm-dir", str(shm_dir), "--socket-group", "", *args, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [error] = [line for line in result.stderr.splitlines() if " ERROR " in line]
    return error


def test_colliding_sockets_are_refused_naming_both_flags(sock_dir: Path, shm_dir: Path) -> None:
    sock = str(sock_dir / "d.sock")
    error = _refused(sock_dir, shm_dir, "--socket", sock, "--admin-socket", sock)
    assert f"--socket and --admin-socket are both {sock}" in error, error
    error = _refused(sock_dir, shm_dir, "--socket", sock, "--fd-socket", sock)
    assert f"--socket and --fd-socket are both {sock}" in error, error
    # The defaults beside --socket collide with a socket named like them.
    error = _refused(sock_dir, shm_dir, "--socket", str(sock_dir / "admin.sock"))
    assert "--socket and --admin-socket are both" in error and "leave it unset" in error, error
    assert not list(sock_dir.iterdir())


def test_a_socket_folder_that_does_not_exist_is_a_typo_not_made(
    sock_dir: Path, shm_dir: Path
) -> None:
    typo = sock_dir / "engarmd" / "deep" / "d.sock"
    error = _refused(sock_dir, shm_dir, "--socket", str(typo))
    assert f"--socket {typo}: its folder {typo.parent} does not exist" in error, error
    assert "install -d -m 0750" in error
    assert not (sock_dir / "engarmd").exists()
    afile = sock_dir / "afile"
    afile.write_text("")
    error = _refused(sock_dir, shm_dir, "--socket", str(afile / "d.sock"))
    assert f"--socket {afile / 'd.sock'}: {afile} is not a folder" in error, error
    error = _refused(
        sock_dir,
        shm_dir,
        "--socket",
        str(sock_dir / "d.sock"),
        "--admin-socket",
        str(sock_dir / "nowhere" / "deep" / "a.sock"),
    )
    assert "--admin-socket" in error and "does not exist" in error, error
    # A folder others may write is no place of the daemon's: its missing folder is not made.
    (sock_dir / "open").mkdir()
    (sock_dir / "open").chmod(0o1777)
    error = _refused(sock_dir, shm_dir, "--socket", str(sock_dir / "open" / "typo" / "d.sock"))
    assert "does not exist" in error and not (sock_dir / "open" / "typo").exists(), error


def test_a_socket_group_named_on_purpose_must_exist(sock_dir: Path, shm_dir: Path) -> None:
    result = engramd(
        "serve",
        "--socket",
        str(sock_dir / "d.sock"),
        "--shm-dir",
        str(shm_dir),
        "--socket-group",
        "nosuchgrp",
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "--socket-group nosuchgrp: no such group" in result.stderr, result.stderr
    assert "groupadd nosuchgrp" in result.stderr and "Traceback" not in result.stderr


def test_a_configured_checkpoint_that_fails_is_shown_by_status_and_systemd(
    checkpoint: Path, daemons: Any, sock_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "no-tables"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["DeepseekV41ForCausalLM"]}')
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(30)
    d = daemons(
        "--checkpoint",
        str(checkpoint),
        "--checkpoint",
        str(broken),
        wait="up",
        env={"NOTIFY_SOCKET": str(sock_dir / "notify")},
    )
    # systemctl status shows the last STATUS= line: the checkpoint and why.
    messages = [notify.recv(4096).decode()]
    while "not ready" not in messages[-1]:
        messages.append(notify.recv(4096).decode())
    notify.close()
    assert not any("READY=1" in m for m in messages)
    assert f"configured checkpoint not loaded: {broken}: " in messages[-1], messages[-1]
    [why] = [m for m in messages[-1].split(f"{broken}: ", 1)[1:]]
    assert why and "see the log" not in why

    text = engramd("status", "--socket", str(d.socket))
    assert text.returncode == 2, text.stdout + text.stderr
    assert f"configured checkpoint {broken} is not loaded: {why.strip()}" in text.stdout
    assert "not ready" in text.stdout
    shown = engramd("status", "--socket", str(d.socket), "--json")
    assert shown.returncode == 2
    doc = json.loads(shown.stdout)
    assert doc["daemon"]["ready"] is False
    assert doc["daemon"]["failed_checkpoints"] == [
        {"checkpoint": str(broken), "error": why.strip()}
    ]
    # The good one is served meanwhile.
    assert [s["state"] for s in doc["sets"]] == ["ready"]
    assert isinstance(doc["sets"][0]["bytes"], int)
    assert all(isinstance(n, int) for n in doc["sets"][0]["bytes_per_node"].values())


def test_status_exits_0_once_ready(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    result = engramd("status", "--socket", str(d.socket), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["daemon"]["failed_checkpoints"] == []


def test_client_commands_read_the_sockets_from_the_daemons_config_file(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "engramd.toml"
    config.write_text(
        f'socket = "{sock_dir / "e.sock"}"\n'
        f'admin-socket = "{sock_dir / "adm.sock"}"\n'
        f'shm_dir = "{shm_dir}"\n'
        'socket_group = ""\n'
        f'checkpoint = ["{checkpoint}"]\n'
    )
    daemon = subprocess.Popen(
        [sys.executable, "-m", "engramd", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: engramd("status", "--config", str(config)).returncode == 0, 60, "ready")
        doc = json.loads(engramd("status", "--config", str(config), "--json").stdout)
        assert doc["daemon"]["socket"] == str(sock_dir / "e.sock")
        [held] = doc["sets"]
        by_env = subprocess.run(
            [sys.executable, "-m", "engramd", "verify", held["set_id"]],
            capture_output=True,
            text=True,
            env={**os.environ, "ENGRAMD_CONFIG": str(config)},
        )
        assert by_env.returncode == 0 and "tensors match" in by_env.stdout, by_env.stderr
        dropped = engramd("drop", held["set_id"], "--config", str(config))
        assert dropped.returncode == 0, dropped.stderr
        loaded = engramd("load", str(checkpoint), "--config", str(config))
        assert loaded.returncode == 0 and "ready" in loaded.stdout, loaded.stderr
        # A flag still wins over the file.
        elsewhere = engramd(
            "status", "--config", str(config), "--socket", str(sock_dir / "x"), "--admin-socket", ""
        )
        assert elsewhere.returncode == 1 and str(sock_dir / "x") in elsewhere.stderr
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=30) == 0
        unmount_below(sets_root(shm_dir))


def test_a_bad_value_in_the_config_file_names_the_file_and_key(
    sock_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "engramd.toml"
    for line, says in (
        ('grace = "soon"', "key 'grace' in "),
        ('memory_budget = "lots"', "key 'memory_budget' in "),
        ('backing = "ram"', "key 'backing' in "),
    ):
        config.write_text(line + "\n")
        result = engramd("serve", "--config", str(config), "--socket", str(sock_dir / "d.sock"))
        assert result.returncode == 2, result.stderr
        flat = " ".join(result.stderr.replace("│", " ").split())
        assert says + str(config) in flat, flat
        assert "ENGRAMD_" not in flat and "'--grace'" not in flat, flat


def test_failed_admin_calls_leave_a_log_line(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [held] = d.status().sets
    empty = tmp_path / "empty"
    empty.mkdir()
    assert engramd("load", str(empty), "--socket", str(d.socket)).returncode == 1
    assert engramd("drop", "0" * 20, "--socket", str(d.socket)).returncode == 1
    assert engramd("verify", "0" * 20, "--socket", str(d.socket)).returncode == 1
    # Changed bytes, as a writer with the daemon's rights could make them.
    folder = sets_root(d.shm_dir) / held.set_id
    [first, *_] = json.loads((folder / "manifest.json").read_text())["tensors"]
    with open(folder / first["file"], "r+b") as f:
        os.pwrite(f.fileno(), b"\xff" * 64, first["offset"])
    assert engramd("verify", held.set_id, "--socket", str(d.socket)).returncode == 1
    wait_until(lambda: "verify of set " + held.set_id in d.log, 10, "the verify's log line")
    log = d.log
    assert f"load of {empty} failed (asked on the admin socket" in log, log
    assert f"drop of set {'0' * 20} failed (asked on the admin socket" in log
    assert f"verify of set {'0' * 20} failed (asked on the admin socket" in log
    assert f"verify of set {held.set_id} (asked on the admin socket" in log
    assert "1 of 4 tensors differ from their checksums" in log


def test_a_verify_that_finds_changed_bytes_stops_serving_the_copy_until_it_is_loaded_again(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    socket = ("--socket", str(d.socket))
    holder = Worker(checkpoint, d.socket)
    workers.append(holder)
    assert holder.hello["mode"] == "shared", holder.hello
    [s] = d.status().sets
    # A verify that finds nothing changed changes nothing.
    assert engramd("verify", s.set_id, *socket).returncode == 0
    [same] = d.status().sets
    assert same.state == "ready" and [lease.stale for lease in same.leases] == [False]

    # One byte changed, as root (or a writer with the daemon's rights) could change it.
    folder = sets_root(d.shm_dir) / s.set_id
    victim = json.loads((folder / "manifest.json").read_text())["tensors"][1]
    with open(folder / victim["file"], "r+b") as f:
        f.seek(victim["offset"] + victim["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = engramd("verify", s.set_id, *socket)
    assert bad.returncode == 1
    assert bad.stdout.strip() == f"corrupted: {victim['name']}"
    fix = f"load it again: engramd load {checkpoint}"
    assert (
        "engramd hands out that copy no more; leases told it is stale: 1; " + fix
    ) in bad.stderr, bad.stderr
    said = f"set {s.set_id} failed verification: the bytes of {victim['name']} no longer match"
    # One line in the daemon's log, naming who asked.
    wait_until(lambda: f"verify of set {s.set_id} (" in d.log, 10, "the verify's log line")
    [line] = [x for x in d.log.splitlines() if f"verify of set {s.set_id} (" in x]
    assert "asked on the admin socket" in line and victim["name"] in line and fix in line, line

    # New attaches are refused, naming the set, the tensor and the fix: auto falls back.
    late = Worker(checkpoint, d.socket)
    workers.append(late)
    assert late.hello["mode"] == "private" and said in late.hello["reason"], late.hello
    assert fix in late.hello["reason"]
    assert late.hello["digests"] == reference_digests(checkpoint)
    wait_until(
        lambda: "fell back to private tables (failed-verification" in d.log, 10, "the report"
    )
    err = attach_error(d, pb.AttachRequest(set_id=s.set_id))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(err) == Reason.FAILED_VERIFICATION and said in str(err.details())

    # The worker holding it is told its copy is stale; status says so.
    wait_until(lambda: holder.ask("lease")["stale"] is True, 10, "the holder told stale")
    [failed] = d.status().sets
    assert failed.state == "failed-verification" and list(failed.changed_tensors) == [
        victim["name"]
    ]
    assert [lease.stale for lease in failed.leases] == [True] and said in failed.error
    text = engramd("status", *socket).stdout
    assert "failed-verification" in text and "STALE: its copy failed verification" in text
    doc = json.loads(engramd("status", *socket, "--json").stdout)
    [shown] = doc["sets"]
    assert (shown["state"], shown["changed_tensors"]) == ("failed-verification", [victim["name"]])
    assert [lease["stale"] for lease in shown["leases"]] == [True]
    # A worker whose stream broke meanwhile gets its lease back, and the news at once.
    request = pb.AttachRequest(
        set_id=s.set_id, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD], reattach=True
    )
    with d.channel() as ch:
        call = pb_grpc.TableServiceStub(ch).Attach(request, timeout=30)
        kinds = []
        for event in call:
            kinds.append(event.WhichOneof("event"))
            if kinds[-1] == "stale":
                assert said in event.stale.reason
                assert list(event.stale.tensors) == [victim["name"]]
                break
        call.cancel()
    assert kinds == ["attached", "stale"]
    # Still so after another verify: only a load makes a new copy.
    assert engramd("verify", s.set_id, *socket).returncode == 1
    assert [x.state for x in d.status().sets] == ["failed-verification"]

    loaded = engramd("load", str(checkpoint), *socket)
    assert loaded.returncode == 0, loaded.stderr
    [again] = d.status().sets
    assert again.state == "ready" and not again.changed_tensors and not again.error
    fresh = Worker(checkpoint, d.socket, share="on")
    workers.append(fresh)
    assert fresh.hello["mode"] == "shared"
    assert fresh.hello["digests"] == reference_digests(checkpoint)
    # The holder moves to the new copy when it refreshes.
    assert holder.ask("refresh")["stale"] is False
    assert holder.ask("digest")["digests"] == reference_digests(checkpoint)
    assert engramd("verify", s.set_id, *socket).returncode == 0
    assert holder.exit() == 0
    [warning] = [x for x in holder.stderr().splitlines() if "failed verification" in x]
    assert warning.startswith(f"WARNING engramd_client: engramd lease for set {s.set_id}: {said}")
    assert "Tables.refresh()" in warning


OUTSIDER = "engramd-t1h"


@pytest.fixture
def outsider() -> Iterator[str]:
    """A real user that is not the daemon's, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    subprocess.run(["userdel", "--force", OUTSIDER], capture_output=True)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", OUTSIDER], check=True, capture_output=True
    )
    try:
        yield OUTSIDER
    finally:
        subprocess.run(["userdel", "--force", OUTSIDER], capture_output=True)


def test_admin_commands_of_another_user_name_the_fix(
    checkpoint: Path, daemons: Any, sock_dir: Path, outsider: str
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [held] = d.status().sets
    command = [*as_user(outsider), "-m", "engramd", "drop", held.set_id, "--socket", str(d.socket)]
    closed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert closed.returncode == 1
    assert "its folder is closed to this user" in closed.stderr, closed.stderr
    assert "failed to connect" not in closed.stderr
    sock_dir.chmod(0o755)  # the folder open, the admin socket still 0600
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert "it is root's only (0600)" in refused.stderr, refused.stderr
    assert "sudo -u root engramd" in refused.stderr
    assert [s.set_id for s in d.status().sets] == [held.set_id]


def test_admin_commands_at_a_socket_under_a_file_say_so(tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for command in (["drop", "0" * 20], ["verify", "0" * 20], ["load", str(tmp_path)]):
        run = engramd(*command, "--socket", str(a_file / "d.sock"))
        assert run.returncode == 1, run.stderr
        assert f"{a_file}/admin.sock" in run.stderr and "Not a directory" in run.stderr
        assert "Traceback" not in run.stderr, run.stderr


def test_settings_that_would_be_ignored_are_refused(sock_dir: Path, shm_dir: Path) -> None:
    sock = str(sock_dir / "d.sock")
    error = _refused(sock_dir, shm_dir, "--socket", sock, "--page-size", "2M")
    assert "--page-size applies to memfd sets only" in error and "--backing memfd" in error
    error = _refused(sock_dir, shm_dir, "--socket", sock, "--evict-idle")
    assert "--evict-idle" in error and "--memory-budget" in error, error
    disk = ("--backing", "disk", "--disk-dir", str(sock_dir), "--numa", "interleave")
    error = _refused(sock_dir, shm_dir, "--socket", sock, *disk)
    assert "--numa interleave places the pages" in error and "--backing tmpfs" in error, error


def test_small_pages_asked_for_are_no_warning(daemons: Any) -> None:
    d = daemons("--no-huge-tmpfs")
    assert "4 KiB pages" in d.log and " WARNING engramd: new sets" not in d.log, d.log


def test_one_daemon_per_hugetlbfs_folder_too(daemons: Any, sock_dir: Path) -> None:
    # hugetlbfs files take no write(): the holder is named from the kernel's lock table.
    with mounted_hugetlbfs(2 << 20) as huge:
        first = daemons(shm=huge)
        (sock_dir / "b").mkdir(mode=0o750)
        second = Daemon(sock_dir / "b" / "d.sock", huge, [], sock_dir / "second.log")
        assert _exit_code(second) == 1
        assert f"another engramd (pid {first.pid}) serves the sets in" in second.log, second.log
        assert first.stop() == 0
