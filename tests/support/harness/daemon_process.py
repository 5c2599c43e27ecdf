"""The demo's daemon process with what only tests vary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from engramd.testing import daemon_process


class DaemonProcess(daemon_process.DaemonProcess):
    """`engramd serve` in a child process, with a test's environment, Python and descriptors."""

    def __init__(
        self,
        socket: Path,
        shm_dir: Path,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        python: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        super().__init__(socket, shm_dir, args, log)
        #: Variables added to the daemon's environment.
        self.env = env or {}
        #: The command that runs Python (this interpreter, or it under prlimit, ...).
        self.python = python or [sys.executable]
        #: Descriptors the daemon inherits (systemd's LISTEN_FDS).
        self.pass_fds = pass_fds

    def command(self) -> list[str]:
        """The daemon's command line, run by `python`."""
        return [*self.python, *super().command()[1:]]

    def popen_options(self) -> dict[str, Any]:
        """The demo's options, with the environment and the descriptors."""
        return {
            **super().popen_options(),
            "env": {**os.environ, **self.env},
            "pass_fds": self.pass_fds,
        }
