"""`engramd serve` in a child process: the demo's daemon (and the benchmark's).

The tests' harness (tests/support/harness/daemon_process.py) adds what only tests vary.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engramd.cli.status_view import fetch
from engramd.config import admin_socket_for
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.pb import engramd_pb2 as pb

START_TIMEOUT_S = 60.0


class DaemonProcess:
    """`engramd serve` in a child process, on the given socket and shm folder."""

    def __init__(
        self,
        socket: Path,
        shm_dir: Path,
        args: list[str],
        log: Path,
    ) -> None:
        self.socket = socket
        self.shm_dir = shm_dir
        self.args = args
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The daemon's command line."""
        return [
            sys.executable,
            "-m",
            "engramd",
            "serve",
            "--socket",
            str(self.socket),
            "--shm-dir",
            str(self.shm_dir),
            *self.args,
        ]

    def popen_options(self) -> dict[str, Any]:
        """What `subprocess.Popen` is given besides the command and the log."""
        # Its own session: a Ctrl-C meant for the parent must not stop it
        # behind the parent's back; the parent stops it in order.
        return {"start_new_session": True}

    def start(self, wait: str = "serving") -> Self:
        """Start the daemon; wait until health says SERVING ("serving"), it answers ("up"),
        or not at all ("no": the caller polls as it pleases)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, **self.popen_options()
            )
        if wait != "no":
            self.wait(serving=wait == "serving")
        return self

    def wait(self, serving: bool) -> None:
        """Return once the daemon answers (`serving`: once health says SERVING); raises
        RuntimeError with its log when it exits first or takes too long."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engramd exited with {self.proc.returncode}:\n{self.log}")
                # An RPC that waits for the socket, in short slices so that a
                # daemon that exits is noticed (channel_ready_future's polling
                # thread would outlive the channel).
                try:
                    health.Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=0.25, wait_for_ready=True
                    )
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise RuntimeError(f"engramd answered {e.code()}:\n{self.log}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engramd did not answer:\n{self.log}") from None
        if not serving:
            return
        # Watch is served on the admin socket (and --health-port), not the worker socket.
        with open_channel(self._admin()) as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""),
                timeout=max(deadline - time.monotonic(), 1),
                wait_for_ready=True,
            )
            try:
                for reply in stream:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        stream.cancel()
                        return
            except grpc.RpcError as e:
                raise RuntimeError(
                    f"engramd never became ready ({e.code()}):\n{self.log}"
                ) from None

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        assert self.proc is not None
        return self.proc.pid

    def channel(self) -> grpc.Channel:
        """A channel to the daemon's socket."""
        # Short reconnect backoff: while the daemon starts, the socket does not
        # exist yet, and gRPC's default first retry comes a second later.
        return open_channel(
            ClientConfig(socket=str(self.socket), reconnect_min_s=0.01, reconnect_max_s=0.1)
        )

    def _admin(self) -> ClientConfig:
        """The daemon's admin socket, reconnected to quickly (it binds after the worker socket)."""
        return ClientConfig(
            socket=admin_socket_for(str(self.socket)), reconnect_min_s=0.01, reconnect_max_s=0.1
        )

    def status(self) -> pb.StatusReply:
        """The daemon's status, asked as `engramd status` asks (its owner: every set)."""
        # A busy machine's daemon may take longer than a person waits.
        return fetch(str(self.socket), admin_socket_for(str(self.socket)), timeout=5)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the daemon and wait for it to exit; returns its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    @property
    def log(self) -> str:
        """Everything the daemon logged so far."""
        return self.log_path.read_text(errors="replace")
