"""docs/deploy.md's by-hand deployment (no systemd as PID 1, no container runtime), followed
step by step: its shell blocks run as they are written there, as root, with a user and
group of this test's own, a venv on the system's interpreter, and the test's folders in
place of /opt, /run/engramd, /var/lib/engramd and /dev/shm; everything removed after.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import Worker, wait_until
from engramd.cli.status_view import fetch
from engramd.host.hugeroot import remove_shm_folder

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy.md"
#: The interpreter the doc makes the venv from.
PYTHON = "/usr/bin/python3"


def doc_blocks() -> list[str]:
    """The shell blocks of deploy.md's "By hand": names, install, start, check, stop."""
    section = DEPLOY.read_text().split("\n## By hand\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def _missing() -> str:
    if os.geteuid() != 0:
        return "the by-hand deployment makes a user and runs as root"
    if subprocess.run([PYTHON, "-m", "venv", "--help"], capture_output=True).returncode != 0:
        return f"{PYTHON} cannot make a venv: apt-get install python3-venv"
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")


@pytest.fixture
def places(open_dirs: tuple[Path, Path, Path]) -> Iterator[dict[str, str]]:
    """The doc's names, this test's own; the user, group, folders and daemon removed after."""
    top = Path(tempfile.mkdtemp(prefix="edh", dir="/tmp"))
    top.chmod(0o755)
    suffix = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    names = {
        "SERVICE_USER": f"edh{suffix}",
        "VENV": str(top / "venv"),
        "RUN_DIR": f"/run/edh{suffix}",
        "STATE_DIR": str(top / "state"),
        "SHM_DIR": f"/dev/shm/engramd-test-byhand-{suffix}",
        "CONFIG": str(top / "etc" / "engramd.toml"),
        "CHECKPOINT": str(open_dirs[2]),
        "SRC": str(ROOT),
        "PYTHON": PYTHON,
    }
    try:
        yield names
    finally:
        pid_file = Path(names["RUN_DIR"]) / "engramd.pid"
        if pid_file.exists():
            with_pid = int(pid_file.read_text())
            try:
                daemon = psutil.Process(with_pid)
                if daemon.username() == names["SERVICE_USER"]:
                    daemon.send_signal(signal.SIGKILL)
                    daemon.wait(30)
            except psutil.NoSuchProcess:
                pass
        subprocess.run(["userdel", names["SERVICE_USER"]], capture_output=True)
        subprocess.run(["groupdel", names["SERVICE_USER"]], capture_output=True)
        shutil.rmtree(names["RUN_DIR"], ignore_errors=True)
        if Path(names["SHM_DIR"]).exists():
            remove_shm_folder(Path(names["SHM_DIR"]))
        shutil.rmtree(top, ignore_errors=True)


def _bash(names: dict[str, str], *blocks: str) -> subprocess.CompletedProcess[str]:
    """The blocks in one bash, after the names, stopping at the first failing command."""
    assignments = "".join(f"{k}={v}\n" for k, v in names.items())
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", assignments + "".join(blocks)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_by_hand_deployment_runs_as_written(
    places: dict[str, str], workers: list[Worker]
) -> None:
    names, install, start, check, stop = doc_blocks()
    # The doc names the same places the test gives its own values for.
    assert re.findall(r"^(\w+)=", names, re.M) == list(places)

    done = _bash(places, install, start, check)
    log = Path(places["STATE_DIR"]) / "engramd.log"
    shown = log.read_text() if log.exists() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{shown}"
    # The check's status: the configured set loaded, served on the doc's socket.
    assert "ready" in done.stdout and places["CHECKPOINT"] in done.stdout, done.stdout

    user = pwd.getpwnam(places["SERVICE_USER"])
    run_dir = Path(places["RUN_DIR"])
    daemon = psutil.Process(int((run_dir / "engramd.pid").read_text()))
    assert daemon.uids().effective == user.pw_uid and daemon.gids().effective == user.pw_gid
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o750 and run_dir.stat().st_uid == user.pw_uid
    # The venv is the service user's to run: its interpreter is the system's.
    assert os.path.realpath(Path(places["VENV"]) / "bin" / "python").startswith("/usr/")

    socket = run_dir / "engramd.sock"
    # CAP_IPC_LOCK locks the set whatever the locked-memory limit.
    wait_until(lambda: fetch(str(socket), timeout=5).sets[0].locked, 60, "the set locked")
    w = Worker(places["CHECKPOINT"], socket, share="on")
    workers.append(w)
    assert w.hello.get("mode") == "shared", (w.hello, log.read_text())
    w.exit()

    stopped = _bash(places, stop)
    assert stopped.returncode == 0, stopped.stderr
    daemon.wait(30)
    assert "engramd stopped; sets kept for the next start" in log.read_text()
