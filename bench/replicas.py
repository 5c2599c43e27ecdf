"""Replica processes (bench/worker.py) started together and measured from outside."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from engramd.testing.child import JsonLinesChild

ROOT = Path(__file__).resolve().parent.parent


class Replica(JsonLinesChild):
    """One bench/worker.py process."""

    def __init__(
        self,
        checkpoint: Path,
        socket: str,
        mode: str,
        wait_go: bool = False,
        prefix: list[str] | None = None,
    ) -> None:
        """Start a replica; `prefix` runs it under another command (unshare ...)."""
        args = [*(prefix or []), sys.executable, "-m", "bench.worker", "--checkpoint"]
        args += [str(checkpoint)]
        args += ["--socket", socket, "--mode", mode] + (["--wait-go"] if wait_go else [])
        super().__init__(args, cwd=ROOT)
        self.ready = self.read()
        #: The worker's reply once attached.
        self.attached: dict[str, Any] = {}

    def uss(self) -> int:
        """Unique set size now: memory only this process holds."""
        return int(psutil.Process(self.proc.pid).memory_full_info().uss)

    def stop(self) -> None:
        """Ask it to exit; kill it if it is stuck."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def replicas(
    checkpoint: Path, socket: str, mode: str, n: int, prefix: list[str] | None = None
) -> Iterator[list[Replica]]:
    """`n` attached replicas; each has its attach reply in `.attached`."""
    started: list[Replica] = []
    try:
        for _ in range(n):
            started.append(Replica(checkpoint, socket, mode, prefix=prefix))
        for r in started:
            r.attached = r.read()
        yield started
    finally:
        for r in started:
            r.stop()


def touch_all(group: list[Replica]) -> None:
    """Every replica faults in every page of its tables (one at a time)."""
    for r in group:
        r.send("touch")
        r.read()
