"""Attach time against a private load, and daemon restart against a reload, per set size."""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

from engramd.testing.daemon_process import DaemonProcess
from engramd_client import attach

from .common import Figure, compare, daemon, percentile, shm_folder

ATTACHES = 20
PRIVATE_LOADS = 3


def attach_once(ckpt: Path, socket: str | None) -> float:
    """Seconds one attach takes: shared through `socket`, or a private load without one."""
    start = time.perf_counter()
    tables = attach(ckpt, socket=socket, share=socket is not None)
    took = time.perf_counter() - start
    tables.close()
    return took


def wait_locked(d: DaemonProcess, timeout_s: float = 300) -> None:
    """Wait until the daemon has locked every set in memory (mlock runs after ready)."""
    deadline = time.monotonic() + timeout_s
    while not all(s.locked for s in d.status().sets):
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon did not lock its set in memory")
        time.sleep(0.05)


def attach_and_restart(sizes: dict[float, Path]) -> list[Figure]:
    """For each size: 20 attaches vs private loads; SIGKILL + restart vs a fresh load."""
    figures = []
    restarts: dict[float, float] = {}
    loads: dict[float, float] = {}
    for gib, ckpt in sizes.items():
        with shm_folder() as shm:
            start = time.perf_counter()
            with daemon(shm, "--checkpoint", str(ckpt)) as d:
                loads[gib] = time.perf_counter() - start
                socket = str(d.socket)
                # After a load the daemon locks the set in the background
                # (mlock, ~0.4 s per GiB); attach latency is measured once it
                # is done, as a worker arriving later would see it.
                wait_locked(d)
                # The first attach of a process also starts gRPC's threads; it
                # is reported apart, the 20 after it are the steady state. The
                # private loads come after them: interleaved, their GiBs of
                # allocation and unmapping would land in the attach latency.
                first = attach_once(ckpt, socket)
                shared = [attach_once(ckpt, socket) for _ in range(ATTACHES)]
                private = [attach_once(ckpt, None) for _ in range(PRIVATE_LOADS)]
                p50, p99 = statistics.median(shared), percentile(shared, 99)
                print(
                    f"  {gib:g} GiB: attach p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms "
                    f"(first in process {first * 1e3:.1f} ms); private load "
                    f"{statistics.median(private) * 1e3:.0f} ms",
                    flush=True,
                )
                figures.append(
                    compare(
                        f"attach p50, {gib:g} GiB",
                        "ms",
                        [p50 * 1e3],
                        [statistics.median(private) * 1e3],
                        higher_is_better=False,
                        target=">= 100x private at 1 GiB" if gib == 1 else "constant in size",
                        at_least=100 if gib == 1 else None,
                        note=f"first attach in a process: {first * 1e3:.1f} ms",
                    )
                )
                figures.append(
                    compare(
                        f"attach p99, {gib:g} GiB",
                        "ms",
                        [p99 * 1e3],
                        None,
                        higher_is_better=False,
                        target="< 10 ms",
                        at_most=10,
                    )
                )
                assert d.proc is not None
                d.stop(signal.SIGKILL)
                start = time.perf_counter()
                d.start()
                restarts[gib] = time.perf_counter() - start
                assert d.status().sets[0].adopted
            print(
                f"  {gib:g} GiB: restart with the set in tmpfs {restarts[gib]:.2f} s, "
                f"start with a load {loads[gib]:.2f} s",
                flush=True,
            )
    for gib in sizes:
        figures.append(
            compare(
                f"daemon restart to ready, {gib:g} GiB",
                "s",
                [restarts[gib]],
                [loads[gib]],
                higher_is_better=False,
                target="< 1 s, constant in size",
                met=restarts[gib] < 1.0,
                note="SIGKILL, start, health SERVING; baseline: start with an empty tmpfs",
            )
        )
    return figures
