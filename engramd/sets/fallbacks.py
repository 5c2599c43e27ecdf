"""The node's replicas that hold private tables, from the records they leave beside the socket.

A worker that falls back writes a record (engramd_shared/fallbacks.py) even
when it cannot reach the daemon; this book reads them on the sweep and at
each status or scrape, counts each record once (`engramd_fallbacks_total`),
and removes the records of workers that are gone. Reading is a scandir and a
few small reads of a tmpfs folder: done on the event loop.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engramd.sets.leases import Stats
from engramd.units import gib
from engramd_shared.errors import CAUSES
from engramd_shared.fallbacks import FallbackRecord, folder_for, read_records
from engramd_shared.process import pid_namespace, start_ticks

#: The cause counted for a record that names none engramd knows.
OTHER_CAUSE = "other"

_PID_NAMESPACE = pid_namespace()

log = logging.getLogger("engramd")


@dataclass(frozen=True)
class Fallback:
    """A replica holding private tables now."""

    #: The record's owner, as the kernel says.
    uid: int
    #: The pid is a live process of that uid in the daemon's pid namespace, started then.
    pid_verified: bool
    record: FallbackRecord

    @property
    def cause(self) -> str:
        """The record's cause where engramd knows it, else "other"."""
        return self.record.cause if self.record.cause in CAUSES else OTHER_CAUSE


class FallbackBook:
    """The records in the socket's folder: listed, counted once each, the stale removed."""

    def __init__(self, socket_path: str, stats: Stats) -> None:
        self._folder = folder_for(socket_path)
        self._stats = stats
        #: Each record counted, by file name (unique while the file exists).
        self._counted: set[str] = set()

    @property
    def folder(self) -> Path:
        """Where the records are."""
        return self._folder

    def scan(self) -> list[Fallback]:
        """The live records now, newest first; each new one counted by its cause."""
        found = []
        names = set()
        for r in read_records(self._folder, time.time()):
            fallback = Fallback(r.uid, _verified(r.uid, r.record), r.record)
            names.add(r.name)
            if r.name not in self._counted:
                self._stats.fallback(fallback.cause)
                log.info(
                    "pid %d (uid %d) fell back to private tables (%s, set %s, %s)",
                    r.record.pid,
                    r.uid,
                    fallback.cause,
                    r.record.set_id,
                    gib(r.record.nbytes),
                )
            found.append(fallback)
        # Only the live ones are remembered: a name is never reused while its file exists.
        self._counted = names
        return found


def _verified(uid: int, record: FallbackRecord) -> bool:
    """The record's pid is, in this pid namespace, a process of `uid` started when it says."""
    if record.pid_namespace != _PID_NAMESPACE or record.pid <= 0:
        return False
    try:
        owner = os.stat(f"/proc/{record.pid}").st_uid
    except OSError:
        return False
    return owner == uid and start_ticks(record.pid) == record.pid_start
