"""Daemon restart until a worker attaches, with the set adopted from tmpfs.

    python -m bench.restart [--size-gib 1] [--reps 5] [--workdir /tmp/engramd-bench]

The worker side is this process, its imports done: each repetition SIGKILLs
the daemon, starts it again and times from the start until `attach` returns
shared tables (the worker retries every 5 ms while the socket refuses it, as
a worker started with the daemon would; each attach opens its own
connection, so gRPC's reconnect backoff, at least 100 ms, does not decide
when it gets in). Also times `engramd --help` and the daemon's own start
until health says SERVING, to show where the time goes.
"""

from __future__ import annotations

import argparse
import compileall
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import engramd
import engramd_client
from engramd.testing.daemon_process import DaemonProcess
from engramd_client import attach

from .attach import wait_locked
from .common import Figure, checkpoint, compare, cpu_seconds, daemon, shm_folder

GOAL_S = 0.3


def _attach_when_up(ckpt: Path, socket: str, timeout_s: float = 30) -> None:
    # A worker started beside the daemon polls for the socket; the strict
    # mode makes a daemon that is not up yet an error instead of a fallback.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            attach(ckpt, socket=socket, share=True).close()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _help_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "engramd", "--help"], capture_output=True, check=True)
    return time.perf_counter() - start


def _byte_compile() -> None:
    # An installed daemon starts from bytecode pip compiled at install time;
    # a checkout under PYTHONDONTWRITEBYTECODE (as here) would compile its ~50
    # modules from source on every start (~0.1 s), which no deployment pays.
    for package in (engramd, engramd_client):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=1)


def restart_to_attach(ckpt: Path, reps: int) -> list[Figure]:
    """Restart-to-attach and restart-to-serving, `reps` times alternately, against `--help`."""
    _byte_compile()
    to_attach: list[float] = []
    to_serving: list[float] = []
    cpu: list[float] = []
    helps: list[float] = []
    with shm_folder() as shm, daemon(shm, "--checkpoint", str(ckpt)) as d:
        wait_locked(d)
        socket = str(d.socket)
        for _ in range(reps):
            helps.append(_help_seconds())
            to_attach.append(_restart(d, "no", lambda: _attach_when_up(ckpt, socket)))
            to_serving.append(_restart(d, "serving", lambda: None))
            cpu.append(cpu_seconds(d.pid))
            assert d.status().sets[0].adopted
    p50 = statistics.median(to_attach)
    print(
        f"  restart to attach p50 {p50 * 1e3:.0f} ms (all {_ms(to_attach)}); restart to "
        f"SERVING p50 {statistics.median(to_serving) * 1e3:.0f} ms; `engramd --help` "
        f"p50 {statistics.median(helps) * 1e3:.0f} ms; the daemon's CPU until SERVING p50 "
        f"{statistics.median(cpu) * 1e3:.0f} ms",
        flush=True,
    )
    return [
        compare(
            "daemon restart to attach (adopted set)",
            "s",
            to_attach,
            helps,
            higher_is_better=False,
            target=f"< {GOAL_S} s",
            met=p50 < GOAL_S,
            note=(
                f"SIGKILL, start, first shared attach; baseline: `engramd --help`; "
                f"restart to SERVING p50 {statistics.median(to_serving):.3f} s, the daemon's "
                f"CPU time until then p50 {statistics.median(cpu):.3f} s (wall time on a "
                "loaded machine is longer by the waits for a core)"
            ),
        )
    ]


def _restart(d: DaemonProcess, wait: str, then: Callable[[], None]) -> float:
    """Seconds from a SIGKILLed daemon's new start until `wait` (DaemonProcess.start) and `then`."""
    d.stop(signal.SIGKILL)
    start = time.perf_counter()
    d.start(wait=wait)
    then()
    return time.perf_counter() - start


def _ms(samples: list[float]) -> str:
    return ", ".join(f"{s * 1e3:.0f}" for s in samples)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/engramd-bench"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    for f in restart_to_attach(checkpoint(args.workdir, args.size_gib), args.reps):
        print(" ", " ".join(f.row()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
