"""A file as the kernel identifies it, and opening one that must be a regular file.

A set records the identity of every file it was read from, so that the
daemon can tell a file changed under a load and a worker's copy can be
proven to be the daemon's.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from engramd_shared.errors import CheckpointError


@dataclass(frozen=True)
class SourceFile:
    """Which file a set was read from, as the kernel identifies it.

    A file rewritten in place keeps its device and inode but not its ctime;
    a file replaced by rename gets another inode. Either way the identity
    differs, where the data samples of the fingerprint may not.
    """

    #: The file's real path (symlinks resolved) where it was read.
    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str], st: os.stat_result) -> SourceFile:
        """The identity of `path` from its stat result."""
        return cls(
            os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
        )

    def same_inode(self, other: SourceFile) -> bool:
        """True when both name the very same file (device and inode)."""
        return (self.dev, self.ino) == (other.dev, other.ino)


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, refused unless it is a regular file.

    Opened non-blocking: a FIFO (or a device) named like a shard would block
    the opening thread forever; here it is refused at once.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from e
    except ValueError as e:  # a NUL byte in the path
        raise CheckpointError(f"{path!r}: not a usable path ({e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(
            f"{path}: not a regular file (a FIFO, device or socket); a checkpoint is made of "
            "regular safetensors files"
        )
    return fd
