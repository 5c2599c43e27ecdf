"""systemd's file descriptor store: memfd sets that outlive a daemon restart.

A memfd lives while a descriptor or a mapping of it does. Under systemd the
daemon hands each set's descriptors to the service manager
(`FDSTORE=1` + `FDNAME=<name>` over the notify socket, the descriptors
attached); the next daemon of the unit gets them back at start:

    LISTEN_PID=<its pid>  LISTEN_FDS=<n>  LISTEN_FDNAMES=<name>:<name>:...
    descriptors 3 .. 3+n-1, in the order of the names

`FDSTOREREMOVE=1` + `FDNAME=` drops a set's entries. systemd keeps the store
only where the unit sets `FileDescriptorStoreMax=` (systemd 254 and later
also say so in $FDSTORE, the number of entries allowed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from engramd.host.sdnotify import Notifier

log = logging.getLogger("engramd")

#: The first descriptor systemd passes (sd_listen_fds).
LISTEN_FDS_START = 3
_PROTOCOL_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_FDS_START")


class FdStore:
    """The service manager's descriptor store, as far as the daemon can tell it is there."""

    def __init__(self, notifier: Notifier, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._notifier = notifier
        #: Entries systemd allows ($FDSTORE, systemd >= 254); None where it does not say.
        self.capacity: int | None = int(env["FDSTORE"]) if env.get("FDSTORE") else None
        self._passed = _listen_fds(env)

    @property
    def available(self) -> bool:
        """Stored descriptors come back to the next daemon (systemd says the store is on)."""
        return self._notifier.enabled and bool(self.capacity)

    def take(self) -> dict[str, int]:
        """The descriptors systemd passed at start, by name; later calls get none."""
        passed, self._passed = self._passed, {}
        return passed

    def store(self, name: str, fd: int) -> bool:
        """Hand `fd` to the service manager under `name`; False where there is no store."""
        if not self._notifier.enabled:
            return False
        return self._notifier.send_fds([fd], FDSTORE=1, FDNAME=name)

    def remove(self, name: str) -> None:
        """Drop the entry `name` from the store (its memory returns once nothing maps it)."""
        if self._notifier.enabled:
            self._notifier.send(FDSTOREREMOVE=1, FDNAME=name)


def _listen_fds(env: Mapping[str, str]) -> dict[str, int]:
    """The descriptors passed to this process (sd_listen_fds_with_names), by name."""
    try:
        pid, count = int(env.get("LISTEN_PID", "0")), int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        log.warning("ignoring malformed LISTEN_PID / LISTEN_FDS")
        return {}
    if pid != os.getpid() or count <= 0:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":")
    passed: dict[str, int] = {}
    for i in range(count):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) else f"unnamed-{i}"
        if name in passed:
            log.warning("systemd passed two descriptors named %r; closing the second", name)
            os.close(fd)
            continue
        passed[name] = fd
    if env is os.environ:
        # Children (none today) must not think these are theirs.
        for key in _PROTOCOL_VARIABLES:
            os.environ.pop(key, None)
    return passed
