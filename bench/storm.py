"""Many workers attaching at the same moment, against one worker alone."""

from __future__ import annotations

import statistics
from pathlib import Path

from .common import Figure, accepting, compare, daemon, percentile, shm_folder
from .replicas import Replica


def _attach_together(ckpt: Path, socket: str, n: int) -> list[float]:
    # Every worker imports torch first and waits; then all get "go" at once,
    # so the storm measures the daemon and the client, not the imports.
    group: list[Replica] = []
    try:
        for _ in range(n):
            group.append(Replica(ckpt, socket, "shared", wait_go=True))
        for r in group:
            r.send("go")
        replies = [r.read() for r in group]
    finally:
        for r in group:
            r.stop()
    modes = {reply["mode"] for reply in replies}
    if modes != {"shared"}:
        raise RuntimeError(f"some workers did not share: {modes}")
    return [reply["attach_s"] * 1e3 for reply in replies]


def attach_storm(ckpt: Path, n: int, reps: int) -> list[Figure]:
    """p50 / p99 attach time of `n` simultaneous workers against one alone, by fd and by path."""
    figures = []
    with shm_folder() as shm, daemon(shm, "--checkpoint", str(ckpt)) as d:
        # The operator's set (0640) goes out either way; workers say which they take.
        for kind, label in (("fd", "by descriptor"), ("shm", "by path")):
            with accepting(kind):
                alone = [t for _ in range(reps) for t in _attach_together(ckpt, str(d.socket), 1)]
                storm = _attach_together(ckpt, str(d.socket), n)
            leases = sum(len(s.leases) for s in d.status().sets)
            p50, p99 = statistics.median(storm), percentile(storm, 99)
            print(
                f"  {n} at once {label}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max "
                f"{max(storm):.1f} ms; one alone p50 {statistics.median(alone):.1f} ms, p99 "
                f"{percentile(alone, 99):.1f} ms; {leases} leases left after all exited",
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
                    note=f"p50 {p50:.1f} ms, all {len(storm)} shared",
                ),
            ]
    return figures
