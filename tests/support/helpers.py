"""Helpers shared by the tests: raw attaches, an in-process daemon."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import pytest
import torch
from safetensors.torch import load_file

from engramd.config import DaemonConfig
from engramd.lifecycle import Daemon, create_server
from engramd_shared.errors import REASON_KEY
from engramd_shared.layout import LOCK_NAME, sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from harness.daemon_process import DaemonProcess

T = TypeVar("T")


def reason(err: grpc.RpcError) -> str:
    """The daemon's reason for an error status (trailing metadata)."""
    return next((str(v) for k, v in err.trailing_metadata() or () if k == REASON_KEY), "")


def set_folders(shm_dir: str | Path) -> list[Path]:
    """What `<shm_dir>/engramd/` holds besides the daemon's lock: sets and loads."""
    return sorted(p for p in sets_root(shm_dir).iterdir() if p.name != LOCK_NAME)


def attach_error(d: DaemonProcess | Path, request: pb.AttachRequest) -> grpc.RpcError | None:
    """Send one raw Attach (to a daemon, or a socket); its error, or None once it handed out
    the set."""
    if not request.pid:
        request.pid = os.getpid()
    if not request.accept:
        # Paths go out for sets the operator published only; descriptors for any.
        request.accept.append(pb.HANDLE_KIND_FD)
    channel = grpc.insecure_channel(f"unix:{d}") if isinstance(d, Path) else d.channel()
    with channel as ch:
        call = pb_grpc.TableServiceStub(ch).Attach(request, timeout=30)
        try:
            next(e for e in call if e.WhichOneof("event") == "attached")
            return None
        except grpc.RpcError as e:
            return e
        finally:
            call.cancel()


class RawLease:
    """An Attach stream held open by the test itself: its lease, secret and handles.

    For tests that speak to the fd channel directly, as a worker (or an
    attacker holding another worker's secret) would.
    """

    def __init__(self, d: DaemonProcess, set_id: str, pid: int = 0) -> None:
        self._channel = d.channel()
        request = pb.AttachRequest(
            set_id=set_id, pid=pid or os.getpid(), accept=[pb.HANDLE_KIND_FD], reattach=True
        )
        self._call = pb_grpc.TableServiceStub(self._channel).Attach(request, timeout=60)
        #: The daemon's Attachment (lease id, fd channel secret, handles).
        self.attachment = next(
            e for e in self._call if e.WhichOneof("event") == "attached"
        ).attached

    def close(self) -> None:
        """End the lease."""
        self._call.cancel()
        self._channel.close()

    def __enter__(self) -> RawLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def engramd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`engramd ARGS` as an operator runs it (this checkout's interpreter); its output."""
    return subprocess.run(
        [sys.executable, "-m", "engramd", *args], capture_output=True, text=True, timeout=timeout
    )


def memfd_mappings(pid: int) -> list[str]:
    """The address ranges of a process's mappings of engramd's memfds."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line.split()[0] for line in maps if "/memfd:engramd-" in line]


def shmem_bytes() -> int:
    """The node's shared memory (tmpfs, shm and memfd pages), from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def open_fds(pid: int) -> int:
    """How many descriptors a process holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def bytes_read(pid: int) -> int:
    """Bytes process `pid` has read through read(2) and its kin so far (rchar: any file)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


def in_process_config(sock_dir: Path, shm_dir: Path, **fields: Any) -> DaemonConfig:
    """A DaemonConfig for an InProcessDaemon: its socket in `sock_dir`, no group, no mlock."""
    defaults: dict[str, Any] = {
        "socket": str(sock_dir / "d.sock"),
        "shm_dir": str(shm_dir),
        "socket_group": "",
        "mlock": False,
    }
    return DaemonConfig(**{**defaults, **fields})


class InProcessDaemon:
    """`create_server(config)` on an event loop in a thread of the test process.

    For tests that pause the daemon at a chosen point (by replacing one of its
    functions) and watch what the rest of it does meanwhile.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server: Daemon = self.run(self._start(config))

    @staticmethod
    async def _start(config: DaemonConfig) -> Daemon:
        server = create_server(config)
        await server.startup()
        return server

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `coro` on the daemon's loop and wait for its result."""
        return self.spawn(coro).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the daemon's loop; its result comes later."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the daemon and its loop."""
        try:
            self.run(self.server.shutdown(grace=1))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()

    def __enter__(self) -> InProcessDaemon:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def reference_digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of each Engram table's bytes, read by the reference safetensors reader."""
    out = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if ".engram.embed." in name:
                out[name] = hashlib.sha256(t.view(torch.uint8).numpy().data).hexdigest()
    return out


@contextlib.contextmanager
def memory_cgroup_folder(limit: int) -> Iterator[tuple[Path, str]]:
    """(a new memory cgroup of `limit` bytes, the name of its limit's file); removed after.

    cgroup v2 (memory.max) or v1 (memory.limit_in_bytes); skips where neither can be made.
    """
    name = f"engramd-test-{secrets.token_hex(4)}"
    for root, limit_file in (
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ):
        # A cgroup hierarchy, not a plain folder (v1 mounts a tmpfs at /sys/fs/cgroup).
        if not (root / "cgroup.procs").exists():
            continue
        folder = root / name
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            (folder / limit_file).write_text(str(limit))
        except OSError:
            folder.rmdir()
            continue
        break
    else:
        pytest.skip("cannot make a memory cgroup here (needs root and cgroup v1 or v2 memory)")
    try:
        yield folder, limit_file
    finally:
        deadline = time.monotonic() + 30
        # Its processes are gone, but the kernel may take a moment to let the cgroup go.
        while subprocess.run(["rmdir", str(folder)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"the cgroup {folder} did not empty in 30 s")
            time.sleep(0.05)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[list[str], str]]:
    """(command prefix that starts Python in a new memory cgroup of `limit` bytes, its name)."""
    with memory_cgroup_folder(limit) as (folder, limit_file):
        join = f'echo $$ > {folder / "cgroup.procs"} && exec "$@"'
        yield ["sh", "-c", join, "sh", sys.executable], f"{folder.name} {limit_file}"


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll `predicate` (an RPC, a file check) until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def load_set(d: Any, folder: Path, replaces: str = "") -> pb.SetInfo:
    """`engramd load` of `folder` on daemon `d`'s admin socket (`replaces`: the set id its
    set replaces as the next generation): the set once ready."""
    with grpc.insecure_channel(f"unix:{d.socket.with_name('admin.sock')}") as channel:
        events = list(
            pb_grpc.AdminServiceStub(channel).Load(
                pb.LoadRequest(checkpoint=str(folder), replaces=replaces), timeout=120
            )
        )
    return events[-1].ready
