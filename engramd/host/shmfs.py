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


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where, what filesystem, with which options."""

    point: Path
    fstype: str
    options: frozenset[str]


def mounts() -> list[Mount]:
    """Every mount this process sees, in mountinfo's order (parents before children)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        # Mount points escape blanks as octal (\040).
        point = Path(fields[4].encode().decode("unicode_escape"))
        options = set(fields[5].split(",")) | set(tail[2].split(",") if len(tail) > 2 else [])
        found.append(Mount(point, tail[0], frozenset(options)))
    return found


def find_mount(folder: str | os.PathLike[str]) -> Mount:
    """The mount that holds `folder` (the last of the deepest, as the kernel resolves it)."""
    path = Path(folder).resolve()
    best = Mount(Path("/"), "", frozenset())
    depth = -1
    for m in mounts():
        if (path == m.point or m.point in path.parents) and len(m.point.parts) >= depth:
            best, depth = m, len(m.point.parts)
    return best


def is_mount_point(folder: str | os.PathLike[str]) -> bool:
    """True when a mount sits right at `folder` (not only somewhere above it)."""
    return find_mount(folder).point == Path(folder).resolve()


def mount_of(folder: str | os.PathLike[str]) -> tuple[str, set[str]]:
    """(filesystem type, mount options) of the mount that holds `folder`."""
    m = find_mount(folder)
    return m.fstype, set(m.options)


def mounts_below(folder: str | os.PathLike[str]) -> list[Path]:
    """Mount points at or under `folder`, deepest first (the order to unmount them in)."""
    path = Path(folder).resolve()
    below = {m.point for m in mounts() if m.point == path or path in m.point.parents}
    return sorted(below, key=lambda p: len(p.parts), reverse=True)


def shmem_enabled() -> str:
    """The kernel's transparent_hugepage/shmem_enabled choice ("never", "within_size", ...)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unavailable"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "unavailable")


def huge_pages(folder: str | os.PathLike[str]) -> bool:
    """True when new files in `folder` are backed by 2 MiB pages (tmpfs huge=, or forced)."""
    fstype, options = mount_of(folder)
    if fstype != "tmpfs":
        return False
    knob = shmem_enabled()
    if knob in ("force", "deny"):
        return knob == "force"
    return any(o.split("=", 1)[-1] in _HUGE_TMPFS for o in options if o.startswith("huge="))


def whole_huge_pages(folder: str | os.PathLike[str]) -> bool:
    """True when a tmpfs gives even a file's tail a whole 2 MiB page (huge=always, or forced).

    huge=within_size gives the part of a file past its last whole 2 MiB small
    pages, so there a file takes its size in 4 KiB pages.
    """
    fstype, options = mount_of(folder)
    if fstype != "tmpfs" or shmem_enabled() == "deny":
        return False
    return shmem_enabled() == "force" or "huge=always" in options


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
