"""systemd's notify protocol: READY=1, STATUS=..., STOPPING=1 over $NOTIFY_SOCKET.

A datagram per message to the socket systemd names in NOTIFY_SOCKET (a path,
or an abstract address written with a leading "@"), descriptors attached
where the message stores them (FDSTORE=1). Without the variable (not under
systemd, Type=notify not set) every call is a no-op.
"""

from __future__ import annotations

import array
import logging
import os
import socket

log = logging.getLogger("engramd")


class Notifier:
    """Sends sd_notify messages; silent when not run by systemd."""

    def __init__(self, address: str | None = None) -> None:
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Run by systemd with a notify socket."""
        return self._address is not None

    def send(self, **fields: str | int) -> None:
        """One message of KEY=value lines: send(READY=1, STATUS="loading")."""
        self.send_fds([], **fields)

    def send_fds(self, fds: list[int], **fields: str | int) -> bool:
        """One message with `fds` attached (SCM_RIGHTS); False where it was not sent."""
        if self._address is None:
            return False
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendmsg([message], rights, 0, self._address)
        except OSError as e:
            # systemd gone or the socket unreachable: the daemon runs on.
            log.debug("sd_notify to %s failed: %s", self._address, e)
            return False
        return True

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
