"""A child process that takes commands on stdin and answers with JSON lines.

The demo's replicas, the benchmark's workers and the tests' workers all
speak this way, so a parent can drive several of them in lockstep: the
parent holds a JsonLinesChild, the child answers with `say`.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any


def say(doc: dict[str, Any]) -> None:
    """Answer the parent: one JSON line on stdout, flushed."""
    print(json.dumps(doc), flush=True)


class JsonLinesChild:
    """`args` in a child process; `send` a command line, `read` its next JSON line."""

    def __init__(self, args: list[str], **popen: Any) -> None:
        self._name = " ".join(args[:4])
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen
        )

    def read(self) -> dict[str, Any]:
        """The child's next JSON line."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self._name} exited with {self.proc.wait()}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def send(self, command: str) -> None:
        """One command line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> dict[str, Any]:
        """Send one command line and return the answer."""
        self.send(command)
        return self.read()
