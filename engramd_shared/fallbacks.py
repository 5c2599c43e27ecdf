"""A worker's fallback record: what a replica that went private leaves where its daemon reads it.

A worker that cannot share may not reach its daemon at all (stopped, still
starting, refused), so it cannot tell it over the socket. The socket's folder
is the one place both always share (a bind mount into every engine container,
the host's /run/engramd): the daemon keeps `fallbacks/` in it, its own folder,
writable by the socket's group (setgid: files take that group; sticky: only a
record's owner or the daemon removes it), mode 3770.

A record is one small JSON file. Its writer holds an exclusive flock on it
for as long as it holds the private tables (the lock goes with the process,
in any PID namespace or container); the daemon lists the records whose lock
is held and removes the others: a worker killed leaves no stale record. The
owner uid the daemon shows is the kernel's (the file's owner); everything in
the record is what the worker said, as a lease's labels are, and is read
bounded: MAX_RECORD_BYTES each, MAX_RECORDS in all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The records' folder, beside the socket.
FOLDER = "fallbacks"
#: Its mode: the socket group writes, files take its group, each removes only its own.
FOLDER_MODE = 0o3770
#: A record's mode: its owner and the socket group (the daemon) read it.
RECORD_MODE = 0o640
#: The most bytes of a record the daemon reads; a longer one is not listed.
MAX_RECORD_BYTES = 4096
#: The most records the daemon reads at once (the newest first).
MAX_RECORDS = 256
#: The longest reason kept in a record.
MAX_REASON = 1000
#: Seconds a record still being written (its name starts with ".") is left alone.
WRITING_GRACE_S = 60.0
_SUFFIX = ".json"


@dataclass(frozen=True)
class FallbackRecord:
    """One worker holding private tables, as it said."""

    #: The worker's pid, in its own pid namespace.
    pid: int
    #: The inode of that pid namespace (0: unknown).
    pid_namespace: int
    #: When that process started, in clock ticks after boot (0: unknown).
    pid_start: int
    #: The set it would have shared.
    set_id: str
    #: The checkpoint it loaded privately.
    checkpoint: str
    #: ShareError.cause: "daemon-unavailable", "capacity", ...
    cause: str
    #: The warning the worker logged (why, and the fix).
    reason: str
    #: Bytes of private tables the worker holds.
    nbytes: int
    #: When it fell back (seconds since the epoch).
    since: float
    #: The lease labels it would have had (engine, ranks).
    labels: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The record's file content."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> FallbackRecord:
        """A record from a file's content; ValueError when it is not one."""
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        labels = doc.get("labels", {})
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ValueError("labels must map text to text")
        values = {
            "pid": _typed(doc, "pid", int),
            "pid_namespace": _typed(doc, "pid_namespace", int),
            "pid_start": _typed(doc, "pid_start", int),
            "set_id": _typed(doc, "set_id", str),
            "checkpoint": _typed(doc, "checkpoint", str),
            "cause": _typed(doc, "cause", str),
            "reason": _typed(doc, "reason", str)[:MAX_REASON],
            "nbytes": _typed(doc, "nbytes", int),
            "since": float(_typed(doc, "since", (int, float))),
        }
        return cls(**values, labels=dict(labels))


def _typed(doc: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{key} is missing or of the wrong type")
    return value


def folder_for(socket_path: str) -> Path:
    """The records' folder of the daemon whose socket is `socket_path`."""
    return Path(socket_path).parent / FOLDER


def leave_record(socket_path: str, record: FallbackRecord) -> int | None:
    """Write `record` beside the daemon's socket and hold its lock: the descriptor to close
    when the private tables go (the record then counts as gone).

    None where there is no such folder (no engramd ever ran here, or one older than
    records) or this process may not write it (not in the socket's group).
    """
    folder = folder_for(socket_path)
    name = f"{record.pid}-{secrets.token_hex(6)}{_SUFFIX}"
    # Written under a hidden name and locked before it gets its own: the daemon never sees
    # an unlocked record of a live worker.
    hidden = folder / f".{name}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(hidden, flags, RECORD_MODE)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, record.to_bytes()[:MAX_RECORD_BYTES])
        os.rename(hidden, folder / name)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(hidden)
        return None
    return fd


@dataclass(frozen=True)
class FoundRecord:
    """A live worker's record, as the daemon read it."""

    #: The file's name (unique while it exists).
    name: str
    #: The record's owner, as the kernel says (the file's uid).
    uid: int
    record: FallbackRecord


def read_records(folder: Path, now: float | None = None) -> Iterator[FoundRecord]:
    """The records in `folder` whose writer still holds them; the others are removed.

    A file that is not a record (a link, too long, not JSON) is skipped, and
    removed once no one holds its lock.
    """
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    entries.sort(key=_mtime, reverse=True)
    for entry in entries[:MAX_RECORDS]:
        found = _read_one(folder, entry, now)
        if found is not None:
            yield found


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _read_one(folder: Path, entry: os.DirEntry[str], now: float) -> FoundRecord | None:
    path = folder / entry.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: no record of anyone's
            with contextlib.suppress(OSError):
                os.unlink(path)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held: its worker lives
        else:
            if not entry.name.startswith(".") or now - st.st_mtime > WRITING_GRACE_S:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        if entry.name.startswith(".") or not entry.name.endswith(_SUFFIX):
            return None
        if st.st_size > MAX_RECORD_BYTES:
            return None
        data = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
        try:
            record = FallbackRecord.from_bytes(data)
        except ValueError:
            return None
        return FoundRecord(entry.name, st.st_uid, record)
    finally:
        os.close(fd)
