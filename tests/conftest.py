"""Fixtures that start the real daemon and real worker processes.

Sockets live in short folders under /tmp (AF_UNIX paths stop at 107 bytes);
sets live in a fresh folder under /dev/shm that is removed afterwards, after
the huge-page tmpfs a daemon run as root mounts over its `engramd/` inside is
unmounted (the daemon leaves it for the next daemon to adopt).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engramd.host.hugeroot import remove_shm_folder, unmount_below
from engramd.testing.child import JsonLinesChild
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.layout import sets_root
from harness.daemon_process import DaemonProcess as Daemon
from helpers import wait_until as wait_until  # the tests import it from here

TESTS = Path(__file__).resolve().parent
#: Helper scripts and modules (on sys.path through pyproject's pytest `pythonpath`).
SUPPORT = TESTS / "support"
WORKER = SUPPORT / "worker.py"
RUN_AS = SUPPORT / "run_as.py"

#: The fleet tests' fixtures (net, nodes, token_file, big_checkpoint), shared by their files.
pytest_plugins = ["fleet_nodes"]


def as_user(user: str) -> list[str]:
    """A command prefix that runs this checkout's Python as `user` (tests/support/run_as.py).

    Skips the test where the suite does not run as root: only root can drop to
    another user.
    """
    if os.geteuid() != 0:
        pytest.skip("running a worker as another user needs root")
    return [sys.executable, str(RUN_AS), user]


class Worker(JsonLinesChild):
    """tests/support/worker.py in a child process: attaches, then answers commands on stdin."""

    def __init__(
        self,
        checkpoint: Path | str,
        socket: Path,
        *,
        share: str = "auto",
        labels: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        user: str | None = None,
        wait: bool = True,
        untouched: bool = False,
    ) -> None:
        """Start the worker; `prefix` runs it under another command (unshare...), as `user`.

        `wait`: read its first line now; else `greeted` reads it later. `untouched`: it
        reads no byte of the tables until asked (its first line has no digests).
        """
        args = [str(WORKER), str(checkpoint), "--socket", str(socket), "--share", share]
        if untouched:
            args.append("--untouched")
        for k, v in (labels or {}).items():
            args += ["--label", f"{k}={v}"]
        python = as_user(user) if user else [sys.executable]
        super().__init__([*(prefix or []), *python, *args], stderr=subprocess.PIPE)
        #: What the worker printed once attached (or its error); {} until then.
        self.hello: dict[str, Any] = self.read() if wait else {}

    def greeted(self) -> Worker:
        """This worker once it printed its first line (started with wait=False)."""
        self.hello = self.read()
        return self

    def stderr(self) -> str:
        """What the worker wrote to stderr (waits for it to exit)."""
        assert self.proc.stderr is not None
        self.proc.wait(timeout=30)
        return self.proc.stderr.read()

    def exit(self) -> int:
        """Ask the worker to close its tables and exit; returns its exit code."""
        if self.proc.poll() is None:
            self.send("exit")
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        self.proc.kill()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def _mounted(fstype: str, options: str) -> Iterator[Path]:
    """A fresh mount of `fstype` in a folder under /tmp; unmounted (lazily) afterwards.

    Lazy: a worker that still maps files of it keeps their pages until it
    exits. Skips the test where mounting is not permitted (needs root).
    """
    path = Path(tempfile.mkdtemp(prefix=f"engramd-{fstype}-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a {fstype} here ({mounted.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
        path.rmdir()


def mounted_tmpfs(size: str) -> contextlib.AbstractContextManager[Path]:
    """A real tmpfs of `size` (mount's syntax: 8m, 64m), unmounted afterwards."""
    return _mounted("tmpfs", f"size={size}")


def mounted_ramfs() -> contextlib.AbstractContextManager[Path]:
    """A ramfs (no size limit, no O_DIRECT), unmounted afterwards."""
    return _mounted("ramfs", "mode=0755")


def mounted_hugetlbfs(page_size: int) -> contextlib.AbstractContextManager[Path]:
    """A hugetlbfs of `page_size` pages, unmounted afterwards."""
    return _mounted("hugetlbfs", f"pagesize={page_size >> 10}K")


@contextlib.contextmanager
def huge_pages(page_size: int, count: int) -> Iterator[int]:
    """Reserve `count` more hugetlb pages of `page_size` bytes; yields how many the kernel granted.

    The old count is restored afterwards. Skips where the pool cannot be changed
    (needs root); the caller decides what a short grant means.
    """
    pool = Path(f"/sys/kernel/mm/hugepages/hugepages-{page_size >> 10}kB/nr_hugepages")
    try:
        old = int(pool.read_text())
        pool.write_text(str(old + count))
    except OSError as e:
        pytest.skip(f"cannot reserve huge pages of {page_size >> 10} kB here ({e}); needs root")
    try:
        yield int(pool.read_text()) - old
    finally:
        pool.write_text(str(old))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for Unix sockets."""
    path = Path(tempfile.mkdtemp(prefix="ed", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh folder under /dev/shm for the daemon's sets; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="engramd-test-", dir="/dev/shm"))
    yield path
    remove_shm_folder(path)


@pytest.fixture
def open_dirs(checkpoint: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(a short folder for sockets, shm folder, checkpoint) that anyone may traverse and read.

    For daemons whose socket group holds real unprivileged users (as_user).
    """
    top = Path(tempfile.mkdtemp(prefix="edo", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="engramd-test-open-", dir="/dev/shm"))
    ckpt = top / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    for p in (top, shm, ckpt, *ckpt.iterdir()):
        p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IXOTH | stat.S_IRGRP | stat.S_IXGRP)
    yield top, shm, ckpt
    shutil.rmtree(top, ignore_errors=True)
    remove_shm_folder(shm)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded synthetic Engram checkpoint: 2 layers, about 21 MB of tables."""
    return synthesize(tmp_path_factory.mktemp("ckpt") / "engram", SynthSpec(rows=40_000))


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A folder on the disk that holds the tests' temporary files (not a tmpfs): the disk
    backing's (`--backing disk --disk-dir`)."""
    folder = tmp_path / "tables"
    folder.mkdir()
    fstype = subprocess.run(
        ["stat", "-f", "-c", "%T", str(folder)], capture_output=True, text=True
    ).stdout.strip()
    if fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{folder} is on {fstype}: the disk backing's tests need a disk")
    return folder


@pytest.fixture
def daemons(sock_dir: Path, shm_dir: Path) -> Iterator[Any]:
    """Make daemons: `daemons(*serve_args, shm=folder, ...)`; every one is stopped afterwards."""
    started: list[Daemon] = []

    def make(
        *args: str,
        wait: str = "serving",
        env: dict[str, str] | None = None,
        python: list[str] | None = None,
        shm: Path | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Daemon:
        d = Daemon(
            sock_dir / "d.sock",
            shm or shm_dir,
            list(args),
            sock_dir / "daemon.log",
            env,
            python,
            pass_fds,
        )
        started.append(d)
        return d.start(wait=wait)

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop(signal.SIGKILL)
    for d in started:
        # Also in a shm folder of the test's own (the huge-page root stays after the daemon).
        unmount_below(sets_root(d.shm_dir))


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """A list to put workers in; every one still running is killed afterwards."""
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.kill()


def start_workers(
    into: list[Worker],
    count: int,
    checkpoint: Path,
    socket: Path,
    share: str = "auto",
    labels: Callable[[int], dict[str, str]] | None = None,
) -> list[Worker]:
    """`count` workers started side by side (each interpreter's start-up, torch's import
    included, overlaps the others'), put in `into` at once; returned once all attached.

    `labels(i)`: the i-th worker's labels.
    """
    started = []
    for i in range(count):
        w = Worker(
            checkpoint, socket, share=share, labels=labels(i) if labels else None, wait=False
        )
        into.append(w)
        started.append(w)
    return [w.greeted() for w in started]
