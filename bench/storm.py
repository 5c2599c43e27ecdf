"""Many workers attaching at the same moment, against one worker alone.

Beside the times, the storm's CPU: what the workers' attaches used (every
thread of each worker, from "go" until its attach returned) and what the
daemon used over the same span. With every worker runnable at once, no
schedule of that work on this machine's cores ends before their sum divided
by the cores: the floor the p99 is read against.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from .common import Figure, accepting, compare, cpu_seconds, daemon, percentile, shm_folder
from .replicas import Replica


@dataclass
class Storm:
    """What one round of workers attaching together measured."""

    #: Each worker's attach, in ms.
    ms: list[float]
    #: Each worker's CPU for its attach (all its threads), in ms.
    worker_cpu_ms: list[float]
    #: The daemon's CPU from "go" until the last worker attached, in ms.
    daemon_cpu_ms: float

    def cpu_note(self) -> str:
        """The round's CPU, and the least time it needs on this machine's cores."""
        workers = sum(self.worker_cpu_ms)
        cores = len(os.sched_getaffinity(0))
        return (
            f"CPU: workers {workers:.0f} ms ({statistics.median(self.worker_cpu_ms):.1f} each), "
            f"daemon {self.daemon_cpu_ms:.0f} ms; on {cores} cores none ends before "
            f"{(workers + self.daemon_cpu_ms) / cores:.0f} ms"
        )


def _attach_together(ckpt: Path, socket: str, daemon_pid: int, n: int) -> Storm:
    # Every worker imports torch first and waits; then all get "go" at once,
    # so the storm measures the daemon and the client, not the imports.
    group: list[Replica] = []
    try:
        for _ in range(n):
            group.append(Replica(ckpt, socket, "shared", wait_go=True))
        before = cpu_seconds(daemon_pid)
        for r in group:
            r.send("go")
        replies = [r.read() for r in group]
        daemon_cpu = cpu_seconds(daemon_pid) - before
    finally:
        for r in group:
            r.stop()
    modes = {reply["mode"] for reply in replies}
    if modes != {"shared"}:
        raise RuntimeError(f"some workers did not share: {modes}")
    return Storm(
        ms=[reply["attach_s"] * 1e3 for reply in replies],
        worker_cpu_ms=[reply["attach_cpu_s"] * 1e3 for reply in replies],
        daemon_cpu_ms=daemon_cpu * 1e3,
    )


def attach_storm(ckpt: Path, n: int, reps: int) -> list[Figure]:
    """p50 / p99 attach time of `n` simultaneous workers against one alone, by fd and by path."""
    figures = []
    with shm_folder() as shm, daemon(shm, "--checkpoint", str(ckpt)) as d:
        # The operator's set (0640) goes out either way; workers say which they take.
        for kind, label in (("fd", "by descriptor"), ("shm", "by path")):
            with accepting(kind):
                alone = [
                    t
                    for _ in range(reps)
                    for t in _attach_together(ckpt, str(d.socket), d.pid, 1).ms
                ]
                storm = _attach_together(ckpt, str(d.socket), d.pid, n)
            leases = sum(len(s.leases) for s in d.status().sets)
            p50, p99 = statistics.median(storm.ms), percentile(storm.ms, 99)
            cpu = storm.cpu_note()
            print(
                f"  {n} at once {label}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max "
                f"{max(storm.ms):.1f} ms; one alone p50 {statistics.median(alone):.1f} ms, p99 "
                f"{percentile(alone, 99):.1f} ms; {leases} leases left after all exited; {cpu}",
                flush=True,
            )
            figures += [
                compare(
                    f"one worker attaching alone {label}, p99",
                    "ms",
                    [percentile(alone, 99)],
                    None,
                    higher_is_better=False,
                    target="reported",
                    note=f"p50 {statistics.median(alone):.1f} ms over {len(alone)}",
                ),
                compare(
                    f"{n} workers attaching at once {label}, p99",
                    "ms",
                    [p99],
                    [statistics.median(alone)],
                    higher_is_better=False,
                    target="all attached, p99 < 250 ms",
                    met=p99 < 250,
                    note=f"p50 {p50:.1f} ms, all {len(storm.ms)} shared; {cpu}",
                ),
            ]
    return figures
