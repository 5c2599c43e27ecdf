"""Long work, as an operator follows it: a load's progress lines in the daemon's log, and its
rate and time left in `engramd status` while it runs.

The daemon is put in a CPU cgroup of a small quota before the load, so the
load of a few tens of MiB takes seconds, as a large one on a busy node does.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engramd.cli.status_view import fetch, render
from engramd.config import admin_socket_for
from engramd.testing.synth import SynthSpec, synthesize
from engramd.units import gib
from engramd_client import plan_tables

#: CPU the daemon may use during the load: 3 ms of every 100 ms (at 1 ms its RPCs starve
#: behind the load's threads and status cannot get through).
QUOTA_US, PERIOD_US = 3_000, 100_000


@contextlib.contextmanager
def cpu_cgroup() -> Iterator[Path]:
    """A new CPU cgroup (v1 cpu.cfs_quota_us or v2 cpu.max) at QUOTA_US of PERIOD_US;
    removed after (its processes must be gone by then)."""
    name = f"engramd-test-{secrets.token_hex(4)}"
    made = None
    for root, limits in (
        (
            Path("/sys/fs/cgroup/cpu"),
            {"cpu.cfs_period_us": PERIOD_US, "cpu.cfs_quota_us": QUOTA_US},
        ),
        (Path("/sys/fs/cgroup"), {"cpu.max": f"{QUOTA_US} {PERIOD_US}"}),
    ):
        if not (root / "cgroup.procs").exists():
            continue
        folder = root / name
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            for file, value in limits.items():
                (folder / file).write_text(str(value))
        except OSError:
            folder.rmdir()
            continue
        made = folder
        break
    if made is None:
        pytest.skip("cannot make a CPU cgroup here (needs root and cgroup v1 or v2 cpu)")
    try:
        yield made
    finally:
        # Whatever is left in it (a daemon a failed test did not stop) goes on at full speed.
        for pid in (made / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (made.parent / "cgroup.procs").write_text(pid)
        deadline = time.monotonic() + 30
        while subprocess.run(["rmdir", str(made)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"the cgroup {made} did not empty in 30 s")
            time.sleep(0.05)


#: "set ID: 5.00 MiB of 61.07 MiB (8%) from files, 0.00 GB/s, 13 s left"
PROGRESS = re.compile(
    r"set (?P<set>\w+): (?P<done>[\d.]+ \w+) of (?P<total>[\d.]+ \w+) \((?P<pct>\d+)%\) "
    r"from (?P<source>[^,]+), (?P<rate>[\d.]+) GB/s, (?P<left>\d+) s left"
)


def _status_while_loading(socket: Path) -> str:
    """`engramd status` (its request and its table) once the set is loading with bytes in.

    Asked with a long timeout: the daemon has little CPU while the load runs.
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            reply = fetch(str(socket), admin_socket_for(str(socket)), timeout=30)
        except grpc.RpcError as e:
            # Starved of CPU, the daemon may not finish a connection's handshake in time.
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            continue
        if any(s.state == "loading" and s.bytes_loaded for s in reply.sets):
            return render(reply)
        time.sleep(0.05)
    raise AssertionError("the set was never seen loading")


def test_a_slow_load_logs_its_progress_and_status_shows_rate_and_time_left(
    tmp_path: Path, daemons: Any
) -> None:
    ckpt = synthesize(tmp_path / "big", SynthSpec(rows=120_000))
    plan = plan_tables(ckpt)
    set_id, total = plan.set_id, gib(plan.nbytes)
    d = daemons("--allow-root", str(tmp_path))
    with cpu_cgroup() as cgroup:
        (cgroup / "cgroup.procs").write_text(str(d.pid))
        load = subprocess.Popen(
            [sys.executable, "-m", "engramd", "load", str(ckpt), "--socket", str(d.socket)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            shown = _status_while_loading(d.socket)
            out, _ = load.communicate(timeout=120)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
        assert load.returncode == 0, out
        # Out of the quota before it stops: a daemon at 1% of a CPU may take longer to shut
        # down than the stop waits, and the cgroup must be empty to go.
        (cgroup.parent / "cgroup.procs").write_text(str(d.pid))
        d.stop()
    # The SOURCE column of the loading set: the source, its rate and the time left.
    assert re.search(r"files [\d.]+ GB/s, \d+ s left", shown), shown
    lines = [m for m in map(PROGRESS.search, d.log.splitlines()) if m]
    assert len(lines) >= 2, d.log
    assert {m["set"] for m in lines} == {set_id}
    assert {m["source"] for m in lines} == {"files"}
    assert {m["total"] for m in lines} == {total}
    shares = [int(m["pct"]) for m in lines]
    assert shares == sorted(shares) and 0 < shares[-1] < 100
    # Then the line when done, with its rate.
    assert re.search(rf"set {set_id} ready: {total} from files in [\d.]+ s \([\d.]+ GB/s\)", d.log)
