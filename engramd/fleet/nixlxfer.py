"""NIXL as engramd uses it: an agent in a transfer process of its own, driven from here.

No NIXL agent runs in the daemon (xferproc.py says why): an Agent takes a
started transfer process (the spare, or a new one), hands it the memory a
transfer moves as descriptors, and forwards each call to it; xferproc.py
names the NIXL calls it makes. The metadata travels over engramd's own gRPC,
so no listener thread and no etcd. An Agent lives for one fill: UCX listens,
and a serving agent's progress thread runs, only while a fill does.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engramd.fleet.base import SourceFailed
from engramd.fleet.netdev import interface_of
from engramd.fleet.xferproc import MESSAGE_BYTES

log = logging.getLogger("engramd")


class TransferFailed(SourceFailed):
    """A NIXL call failed, a transfer ended in error or outlived its deadline, or the
    transfer process died."""


class NixlMissing(SourceFailed):
    """NIXL cannot be imported here; the message names the fix."""


#: NIXL's builds, by the CUDA they were made for; any of them moves host memory.
BUILDS = ("nixl_cu12", "nixl_cu13")
#: Seconds one poll of a transfer may keep the transfer process busy: the
#: daemon looks at its cancel flag and deadline between polls.
POLL_SLICE_S = 0.1
#: Seconds a transfer process has to start its agent.
START_TIMEOUT_S = 30.0
#: What of the daemon's environment a transfer process sees: UCX's and NIXL's
#: settings and what an interpreter needs; never a token, a key or the rest.
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "HOME")
PASSED_PREFIXES = ("UCX_", "NIXL_")
#: UCX's TCP segments (64 KiB and 8 KiB by default): a fill of 1 GiB over a veth moved
#: 1.19 GB/s with these against 0.89 with UCX's own, median of 6 alternating turns. UCX
#: refuses a send segment larger than the receive one, so both are set, or neither.
TCP_SEGMENTS = {"UCX_TCP_RX_SEG_SIZE": "256k", "UCX_TCP_TX_SEG_SIZE": "256k"}
#: Where the kernel lists RDMA devices: without one, UCX here moves bytes over TCP only.
RDMA_DEVICES = Path("/sys/class/infiniband")
#: NIXL imports numpy, whose OpenBLAS starts a thread a core that spins a while (0.13
#: CPU-seconds of every transfer process's start here); a transfer process does no algebra.
NO_BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1"}
#: UCX's memory events keep the registration cache of RDMA transports true; they cost 0.4 s
#: of every transfer process's start (UCX patches malloc and mmap as NIXL loads its UCX
#: plugin), for nothing over TCP, which registers nothing: off where no RDMA device exists
#: and the daemon's own UCX_MEM_EVENTS says nothing.
NO_MEMORY_EVENTS = {"UCX_MEM_EVENTS": "no"}


def nixl_build() -> str:
    """The name of an installed NIXL build's module; raises NixlMissing."""
    # The build's own module, not the `nixl` meta package: that one picks a
    # build by the CUDA it finds, and without one imports torch to ask it
    # (nixl_meta_utils.detect_cuda_major).
    for build in BUILDS:
        if importlib.util.find_spec(build) is not None:
            return build
    raise NixlMissing(
        "NIXL is not installed (no module named 'nixl_cu12' or 'nixl_cu13'); install it with "
        "`pip install --no-deps nixl-cu12==1.5.1 numpy` (make setup does)"
    )


def agent_name(purpose: str) -> str:
    """A name no other agent of the fleet has: the host, the purpose, a nonce."""
    return f"engramd-{socket.gethostname()}-{purpose}-{secrets.token_hex(4)}"


def transfer_env(device: str, prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """What a transfer process is given at its start for a fill whose UCX may use only
    network `device`: the daemon's variables that start with `prefixes`, the device, and
    UCX's TCP segment sizes where the daemon's environment sets neither."""
    env = {k: v for k, v in os.environ.items() if k.startswith(prefixes)} if prefixes else {}
    if device:
        # UCX opens a TCP listener on every interface it uses (all of them by
        # default, loopback included): only the peer network's, then.
        env["UCX_NET_DEVICES"] = device
        if not any(k in os.environ for k in TCP_SEGMENTS):
            env.update(TCP_SEGMENTS)
    return env


def start_env() -> dict[str, str]:
    """The environment a transfer process starts with: the daemon's variables it may see,
    and what keeps its start short (NO_BLAS_THREADS, NO_MEMORY_EVENTS)."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith(PASSED_PREFIXES)}
    env.update(NO_BLAS_THREADS)
    return env if _has_rdma() else {**NO_MEMORY_EVENTS, **env}


def _has_rdma() -> bool:
    try:
        return any(RDMA_DEVICES.iterdir())
    except FileNotFoundError:
        return False
    except OSError:
        # Unreadable: keep UCX's memory events, as for a host with RDMA.
        return True


class _Process:
    """A transfer process started, its agent named, not yet given a fill."""

    def __init__(self) -> None:
        env = start_env()
        env["ENGRAMD_NIXL_BUILD"] = nixl_build()
        self.name = agent_name("xfer")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "engramd.fleet.xferproc", str(theirs.fileno()), self.name],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                cwd="/",
            )
        except OSError as e:
            ours.close()
            raise TransferFailed(f"cannot start a transfer process ({e})") from None
        finally:
            theirs.close()
        self.sock = ours


class _Spare:
    """One transfer process started ahead of the next fill, for a daemon of a fleet: a fill
    then waits only for its backend (UCX: about 0.1 s), not for an interpreter and NIXL's
    plugins (about 0.5 s here). It listens nowhere and holds nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: _Process | None = None
        self._kept = False

    def keep(self) -> None:
        """From now on, keep one ready."""
        with self._lock:
            self._kept = True
        self.refill()

    def take(self) -> _Process:
        """A started process: the spare if one is ready and alive, else a new one."""
        with self._lock:
            spare, self._ready = self._ready, None
        if spare is not None and spare.popen.poll() is not None:
            spare.sock.close()
            spare = None
        return spare if spare is not None else _Process()

    def refill(self) -> None:
        """Start the next spare, if one is kept and none is ready: when a fill ends, so that
        an interpreter's start never takes a core from a fill."""
        with self._lock:
            if not self._kept or self._ready is not None:
                return
            try:
                self._ready = _Process()
            except SourceFailed as e:
                log.warning("cannot start a spare transfer process: %s", e)


#: The daemon's spare transfer process (kept once a fleet part asks for it).
spare = _Spare()


class Agent:
    """One NIXL agent in a transfer process of its own; one user at a time, one fill long.

    `backends`: each backend made (UCX, OBJ) with its parameters. `peer`: the
    address of the other end (a receiver or a server), whose route names the
    only network interface UCX may use; "" for an agent without UCX (object
    storage, which is given the daemon's AWS_ variables: its SDK takes
    credentials from them, and nothing listens there). `serves`: the other
    end reads from this agent, so UCX's progress thread must serve it; an
    agent that reads drives its own transfers (`wait` polls them) and runs no
    such thread, which would spin on a core the fill needs. `close` ends the
    process; every call after a failure of the process raises TransferFailed.
    """

    def __init__(
        self, backends: dict[str, dict[str, str]], peer: str = "", serves: bool = False
    ) -> None:
        try:
            env = transfer_env(interface_of(peer)) if peer else transfer_env("", ("AWS_",))
        except (OSError, ValueError) as e:
            raise TransferFailed(f"no network interface reaches {peer} ({e})") from None
        started = spare.take()
        self.name = started.name
        self._process = started.popen
        self._sock = started.sock
        self._dead = ""
        self._sock.settimeout(START_TIMEOUT_S)
        try:
            self._call("start", backends=backends, env=env, progress_thread=serves)
        except TransferFailed as e:
            self.close()
            raise TransferFailed(_start_failed(e, peer, env)) from None
        self._sock.settimeout(None)

    def _call(self, op: str, fds: list[int] | None = None, **args: Any) -> Any:
        if self._dead:
            raise TransferFailed(self._dead)
        message = json.dumps({"op": op, **args}).encode()
        try:
            if fds:
                socket.send_fds(self._sock, [message], fds)
            else:
                self._sock.send(message)
            data = self._sock.recv(MESSAGE_BYTES)
        except OSError as e:
            data, why = b"", str(e)
        else:
            why = ""
        if not data:
            self._dead = f"the transfer process ended ({self._ending(why)})"
            raise TransferFailed(self._dead)
        reply = json.loads(data)
        if "error" in reply:
            raise TransferFailed(str(reply["error"]))
        return reply["ok"]

    def _ending(self, why: str) -> str:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return why or "it stopped answering"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def ended(self) -> str:
        """How the transfer process ended ("killed by SIGSEGV"), or "" while it runs."""
        if self._process.poll() is None:
            return ""
        return f"ended ({self._ending('')})"

    def attach(self, memory: list[tuple[int, int, int]], writable: bool) -> list[int]:
        """Map each (fd, offset, bytes) of `memory` in the transfer process, writable there
        or read-only, and register it with NIXL as DRAM; their addresses there."""
        if not memory:
            return []
        specs = [(offset, nbytes, writable) for _, offset, nbytes in memory]
        addresses: list[int] = self._call("map", fds=[fd for fd, _, _ in memory], regions=specs)
        return addresses

    def register(self, regions: list[tuple[int, int, int, str]], mem: str) -> int:
        """Register (address, size, device, meta) regions of `mem` ("DRAM", "OBJ"), at the
        transfer process's addresses; its handle."""
        try:
            handle: int = self._call("register", regions=regions, mem=mem)
        except TransferFailed as e:
            raise TransferFailed(f"cannot register {mem} memory with NIXL ({e})") from None
        return handle

    def metadata(self) -> bytes:
        """This agent's metadata, its registered memory included, for a peer's add_remote."""
        return base64.b64decode(self._call("metadata"))

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; the peer's agent name."""
        try:
            name: str = self._call("add_remote", metadata=base64.b64encode(metadata).decode())
        except TransferFailed as e:
            raise TransferFailed(f"the peer's NIXL metadata was refused ({e})") from None
        return name

    def post(
        self,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_mem: str,
        remote_agent: str,
    ) -> int:
        """Start a READ of `remote` descriptors into `local` DRAM ones; its handle for `wait`."""
        try:
            xfer: int = self._call(
                "post", local=local, remote=remote, remote_mem=remote_mem, agent=remote_agent
            )
        except TransferFailed as e:
            raise TransferFailed(f"NIXL could not start the read ({e})") from None
        return xfer

    def wait(self, handle: int, deadline: float, cancel: threading.Event) -> None:
        """Return once the read of `handle` is complete (it is then released).

        Raises TransferFailed on an error, past `deadline` (time.monotonic), or
        once `cancel` is set.
        """
        while True:
            state = self._call("wait", xfer=handle, slice_s=POLL_SLICE_S)
            if state == "DONE":
                return
            if state != "PROC":
                raise TransferFailed("NIXL reported the read failed")
            if cancel.is_set():
                raise TransferFailed("the load was cancelled")
            if time.monotonic() > deadline:
                raise TransferFailed("the read outlived its deadline")

    def done(self, handle: int) -> bool:
        """Whether the read of `handle` is complete, without waiting; raises TransferFailed
        when it failed."""
        state = self._call("wait", xfer=handle, slice_s=0)
        if state not in ("DONE", "PROC"):
            raise TransferFailed("NIXL reported the read failed")
        return bool(state == "DONE")

    def states(self, handles: list[int]) -> dict[int, str]:
        """The reads of `handles` that ended, with how ("DONE" or "ERR"), without waiting;
        each ended read is released and reported once."""
        states: list[str] = self._call("states", xfers=handles)
        return {h: s for h, s in zip(handles, states, strict=True) if s != "PROC"}

    def read(
        self,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_mem: str,
        remote_agent: str,
        deadline: float,
        cancel: threading.Event,
    ) -> None:
        """`post` then `wait`: returns once every byte arrived."""
        self.wait(self.post(local, remote, remote_mem, remote_agent), deadline, cancel)

    def close(self) -> None:
        """End the transfer process and wait for it: once this returns, nothing it started
        writes into memory any more."""
        self._sock.close()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._dead = self._dead or "the transfer process was closed"
        spare.refill()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _start_failed(e: TransferFailed, peer: str, env: dict[str, str]) -> str:
    """Why this node's own transfer process could not start its agent, and the fix: the
    failing side is this node, never the peer."""
    if not peer:
        return f"this node's transfer process could not start its NIXL agent ({e})"
    device = env.get("UCX_NET_DEVICES", "")
    return (
        f"this node's transfer process could not start its NIXL agent ({e}): UCX found no "
        f"usable network device for the route to {peer} (UCX_NET_DEVICES={device}); the "
        "peer is not at fault. Where engramd runs in a network namespace entered with "
        "`nsenter --net`, /sys is the host's and UCX sees only lo: start it with `ip netns "
        "exec` (which mounts the namespace's /sys), or in the pod's own namespaces"
    )
