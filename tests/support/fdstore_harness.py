"""A stand-in for systemd's side of sd_notify and its fd store, for real daemons in tests.

Binds the notify socket a daemon finds in NOTIFY_SOCKET, keeps every
descriptor it stores (FDSTORE=1, FDNAME=), forgets the ones it removes
(FDSTOREREMOVE=1), and starts the next daemon with them as LISTEN_FDS
(tests/support/listen_fds.py), as systemd does for a unit with FileDescriptorStoreMax=.
"""

from __future__ import annotations

import array
import os
import socket
import sys
import threading
from pathlib import Path
from types import TracebackType

from conftest import SUPPORT


class FdStoreHarness:
    """The notify socket and the stored descriptors, by name."""

    def __init__(self, folder: Path, capacity: int = 64) -> None:
        self.path = folder / "notify.sock"
        self.capacity = capacity
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(str(self.path))
        self._lock = threading.Lock()
        self._stored: dict[str, int] = {}
        self._closing = False
        #: Every message received, as KEY=value dicts, in order.
        self.messages: list[dict[str, str]] = []
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        rights_size = socket.CMSG_SPACE(253 * array.array("i").itemsize)
        while True:
            data, ancillary, _, _ = self._sock.recvmsg(65536, rights_size)
            if self._closing:
                return
            fds = array.array("i")
            for level, kind, payload in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.messages.append(fields)
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1" and len(fds) == 1:
                    old = self._stored.pop(name, None)
                    if old is not None:
                        os.close(old)
                    self._stored[name] = fds[0]
                    continue
                if fields.get("FDSTOREREMOVE") == "1" and name in self._stored:
                    os.close(self._stored.pop(name))
            for fd in fds:
                os.close(fd)

    @property
    def names(self) -> set[str]:
        """Names of the descriptors stored now."""
        with self._lock:
            return set(self._stored)

    def env(self) -> dict[str, str]:
        """What systemd puts in a daemon's environment for its notify socket and store."""
        return {"NOTIFY_SOCKET": str(self.path), "FDSTORE": str(self.capacity)}

    def launcher(self) -> tuple[list[str], tuple[int, ...]]:
        """(command prefix that runs Python with the stored descriptors as LISTEN_FDS, fds)."""
        with self._lock:
            stored = dict(self._stored)
        spec = ",".join(f"{name}={fd}" for name, fd in stored.items())
        prefix = [sys.executable, str(SUPPORT / "listen_fds.py"), spec, "--", sys.executable]
        return prefix, tuple(stored.values())

    def close(self) -> None:
        """Stop listening and close every stored descriptor (systemd stopping the unit)."""
        self._closing = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
            wake.sendto(b"", str(self.path))
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            for fd in self._stored.values():
                os.close(fd)
            self._stored.clear()

    def __enter__(self) -> FdStoreHarness:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
