"""The transfer process: the one place a NIXL agent runs, apart from the daemon.

UCX over TCP serves RMA reads and writes at any address of the process that
owns the agent, to anyone who can reach its port, whatever was registered
(NIXL checks descriptors on the initiator's side only). So no agent lives in
the daemon: each fill starts one of these processes, which holds only what
that fill moves (the mapped tensors of one set, read-only, on the serving
side; a landing ring of its own on the receiving side, never the set being
filled: landing.py), no token, no other set and none of the daemon's heap,
and which ends with the fill. A fault that a peer provokes over the network (a write into a
read-only mapping, a read of an unmapped address) ends this process; the
daemon sees the fill fail and moves on. Late writes of a request NIXL has
already reported failed (its OBJ backend does that) land in its own
memory and end with the process.

Started by nixlxfer (`python -m engramd.fleet.xferproc FD NAME`) with a
scrubbed environment, ahead of the fill that takes it; FD is its end of a
SOCK_SEQPACKET socketpair. Until a fill starts it, it has NIXL loaded and
its agent made without backends: no listener, no thread, no memory of a
set. Each request is one JSON message (descriptors attached where a request
maps memory), each reply one JSON message: {"ok": ...} or {"error": "..."}.
It ends when its end of the socket closes: when the daemon closes the fill,
or dies (no request keeps it from the socket for longer than a poll).

The NIXL calls it makes are nixl_cu12/_api.py's (nixl-cu12 1.5.1):
nixl_agent(name, nixl_agent_config(enable_prog_thread=..., enable_listen_thread=False,
backends=[])),
get_plugin_params, create_backend, register_memory, get_agent_metadata,
add_remote_agent, get_xfer_descs, initialize_xfer("READ", ...), transfer,
check_xfer_state, release_xfer_handle.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import select
import socket
import sys
import time
from typing import Any

from engramd.backings.regions import Region

#: Bytes of one request or reply; NIXL metadata of one agent is a few KiB.
MESSAGE_BYTES = 1 << 20
#: Descriptors one request may carry (one per mapped tensor).
MAX_FDS = 4096
#: Seconds between two polls of the transfers in flight. Polled busily, this process took a
#: core the daemon's digest needed (2 cores: a GiB from a peer in 2.1-2.2 s, against 1.8-1.9 s
#: with a pause of 0.5-1 ms).
POLL_PAUSE_S = 0.0005
#: The plugins loaded ahead of a fill: the peers' and the object store's.
PLUGINS = ("UCX", "OBJ")
#: Microseconds UCX's progress thread (a serving agent's) waits on its workers' event
#: descriptors before it polls them anyway. nixl_agent sets 0 (nixl_cu12/_api.py:
#: `agent_config.pthrDelay = 0`), and the thread's poll(2) then never blocks: it spun a core
#: for the whole fill, half of this 2-core host, beside the sends it exists for. Waiting,
#: it wakes when a receiver's request arrives or a send buffer drains.
PROGRESS_WAIT_US = 10_000


def _waiting_config(config: Any) -> Any:
    """NIXL's agent config class with `pthrDelay` held at PROGRESS_WAIT_US, whatever
    nixl_agent assigns (it offers no setting of its own for it)."""
    field = config.pthrDelay

    class Waiting(config):
        @property
        def pthrDelay(self) -> int:  # NIXL's name
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _: int) -> None:
            field.__set__(self, PROGRESS_WAIT_US)

    return Waiting


class _Transfers:
    """The agent, the memory mapped for it and its transfers, by the ids the daemon uses."""

    def __init__(self) -> None:
        self.api: Any = None
        self.name = ""
        self.agent: Any = None
        self.regions: list[Region] = []
        self.registered: dict[int, Any] = {}
        self.xfers: dict[int, Any] = {}
        #: The final state of transfers released already, until the daemon has seen it.
        self.finished: dict[int, str] = {}
        self._next = 0

    def _id(self) -> int:
        self._next += 1
        return self._next

    def prepare(self, name: str) -> None:
        """NIXL's plugins loaded: nothing listens, nothing runs."""
        self.api = importlib.import_module(f"{os.environ['ENGRAMD_NIXL_BUILD']}._api")
        self.api.nixlBind.nixlAgentConfig = _waiting_config(self.api.nixlBind.nixlAgentConfig)
        self.name = name
        # Loading a plugin is most of an agent's start (0.4 s of 0.5 here), and the
        # plugins stay loaded for the process (NIXL's plugin manager is one per
        # process); the fill's agent and its backends are made when it starts.
        loader = self._agent(progress_thread=False)
        for plugin in PLUGINS:
            loader.get_plugin_params(plugin)

    def _agent(self, progress_thread: bool) -> Any:
        return self.api.nixl_agent(
            self.name,
            self.api.nixl_agent_config(
                enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[]
            ),
        )

    def start(
        self, backends: dict[str, dict[str, str]], env: dict[str, str], progress_thread: bool
    ) -> None:
        # UCX and the AWS SDK read their settings when the backend is made.
        os.environ.update(env)
        self.agent = self._agent(progress_thread)
        for backend, values in backends.items():
            self.agent.create_backend(backend, values)

    def map(self, specs: list[list[Any]], fds: list[int]) -> list[int]:
        if len(specs) != len(fds):
            raise ValueError(f"{len(specs)} regions came with {len(fds)} descriptors")
        addresses = []
        for (offset, nbytes, writable), fd in zip(specs, fds, strict=True):
            try:
                region = Region(fd, int(offset), int(nbytes), bool(writable))
            finally:
                os.close(fd)
            self.regions.append(region)
            addresses.append(region.address)
        if any(nbytes for _, nbytes, _ in specs):
            self.register(
                [[a, n, 0, ""] for a, (_, n, _) in zip(addresses, specs, strict=True) if n], "DRAM"
            )
        return addresses

    def register(self, regions: list[list[Any]], mem: str) -> int:
        handle = self.agent.register_memory([tuple(r) for r in regions], mem)
        key = self._id()
        self.registered[key] = handle
        return key

    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def add_remote(self, metadata: str) -> str:
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        return name.decode() if isinstance(name, bytes) else str(name)

    def post(
        self, local: list[list[int]], remote: list[list[int]], remote_mem: str, agent: str
    ) -> int:
        a = self.agent
        handle = a.initialize_xfer(
            "READ",
            a.get_xfer_descs([tuple(d) for d in local], "DRAM"),
            a.get_xfer_descs([tuple(d) for d in remote], remote_mem),
            agent,
        )
        try:
            state = a.transfer(handle)
        except BaseException:
            a.release_xfer_handle(handle)
            raise
        if state == "ERR":
            a.release_xfer_handle(handle)
            raise RuntimeError("NIXL reported the read failed")
        key = self._id()
        self.xfers[key] = handle
        return key

    def wait(self, xfer: int, slice_s: float) -> str:
        """The transfer's state after polling it for up to `slice_s` seconds, POLL_PAUSE_S
        apart; a finished one (DONE or ERR) is released."""
        if xfer in self.finished:
            return self.finished[xfer]
        handle = self.xfers[xfer]
        until = time.monotonic() + slice_s
        state = self._state(handle)
        while state == "PROC" and time.monotonic() < until:
            time.sleep(POLL_PAUSE_S)
            state = self._state(handle)
        if state != "PROC":
            self.release(xfer)
            self.finished[xfer] = state
        return state

    def states(self, xfers: list[int]) -> list[str]:
        """Each transfer's state now, without waiting; a finished one is released and, once
        told, forgotten."""
        found = [self.wait(xfer, 0.0) for xfer in xfers]
        for xfer, state in zip(xfers, found, strict=True):
            if state != "PROC":
                self.finished.pop(xfer, None)
        return found

    def progress(self) -> None:
        """Poll every transfer in flight once; a finished one (DONE or ERR) is released."""
        for xfer, handle in list(self.xfers.items()):
            state = self._state(handle)
            if state != "PROC":
                self.release(xfer)
                self.finished[xfer] = state

    def _state(self, handle: Any) -> str:
        """A transfer's state: DONE, PROC, or ERR (also when NIXL raises instead, as its
        bindings may for a backend's error: one failed read must not fail the others)."""
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def release(self, xfer: int) -> None:
        handle = self.xfers.pop(xfer, None)
        if handle is not None:
            self.agent.release_xfer_handle(handle)


def _serve(sock: socket.socket, name: str) -> None:
    transfers = _Transfers()
    try:
        transfers.prepare(name)
    except Exception as e:
        sock.send(json.dumps({"error": f"NIXL cannot start here: {e}"}).encode())
        return
    while True:
        # A reader's UCX moves bytes only while its transfers are polled (it runs no
        # progress thread): between the daemon's requests this process polls what is in
        # flight, and blocks on the socket only when nothing is.
        while transfers.xfers and not select.select([sock], [], [], POLL_PAUSE_S)[0]:
            transfers.progress()
        try:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, MAX_FDS)
        except ConnectionResetError:
            return
        if not data:
            return
        try:
            request = json.loads(data)
            op = request.pop("op")
            if op == "map":
                reply: dict[str, Any] = {"ok": transfers.map(request["regions"], fds)}
                fds = []
            else:
                reply = {"ok": getattr(transfers, op)(**request)}
        except Exception as e:  # every failure goes back to the daemon, in one line
            reply = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


def main() -> None:
    """Serve the daemon's requests on the descriptor argv[1] for the agent named argv[2] until
    the socket closes."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        _serve(sock, sys.argv[2])
    finally:
        sock.close()


if __name__ == "__main__":
    main()
