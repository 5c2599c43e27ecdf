"""Facts about the filesystem behind a folder: sizes, huge pages, mount identity."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_HUGE_TMPFS = {"always", "within_size"}


@dataclass(frozen=True)
class ShmUsage:
    """Sizes of the filesystem behind a folder, in bytes."""

    dir: str
    total: int
    used: int
    free: int


def usage(folder: str | os.PathLike[str]) -> ShmUsage:
    """Total, used and free bytes of the filesystem that holds `folder`."""
    st = os.statvfs(folder)
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    return ShmUsage(dir=str(folder), total=total, used=total - st.f_bfree * st.f_frsize, free=free)


def mount_of(folder: str | os.PathLike[str]) -> tuple[str, set[str]]:
    """(filesystem type, mount options) of the mount that holds `folder`."""
    path = Path(folder).resolve()
    best: tuple[int, str, set[str]] = (-1, "", set())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        # Mount points escape blanks as octal (\040).
        mount_point = Path(fields[4].encode().decode("unicode_escape"))
        if (path == mount_point or mount_point in path.parents) and len(str(mount_point)) >= best[
            0
        ]:
            options = set(fields[5].split(",")) | set(tail[2].split(",") if len(tail) > 2 else [])
            best = (len(str(mount_point)), tail[0], options)
    return best[1], best[2]


def huge_pages(folder: str | os.PathLike[str]) -> bool:
    """True when new files in `folder` are backed by 2 MiB pages (tmpfs huge=, or forced)."""
    fstype, options = mount_of(folder)
    if fstype != "tmpfs":
        return False
    try:
        forced = "[force]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        forced = False
    return forced or any(
        o.split("=", 1)[-1] in _HUGE_TMPFS for o in options if o.startswith("huge=")
    )


def mount_id(path: str | os.PathLike[str]) -> int:
    """The kernel's id of the mount that holds `path` (differs across bind mounts)."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    finally:
        os.close(fd)
    raise OSError(f"no mnt_id for {path} in /proc/self/fdinfo")
