"""The daemon's own folder in the shm folder: made by it, or refused.

In /dev/shm every user may create `engramd/` before the daemon does (after a
reboot, say) and then rename or replace what the daemon puts inside. So the
daemon uses `<shm_dir>/engramd` only when it is a real folder that the
daemon's user owns and nobody else may write. Anything else there is moved
aside with a log line when the daemon may do so (as root), a mount that is
not the daemon's is detached, or the start fails, naming the fix. Workers
check the same ownership before they map.

One daemon per folder: a second daemon on the same shm folder would adopt the
first's sets and, with --drop-on-exit, delete them under the first. So a
daemon holds an exclusive flock on `<shm_dir>/engramd/.lock` (RootLock) from
before it adopts anything until it exits; the kernel drops the lock with the
process, however it ends, so a restart (systemd's included) finds it free.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from engramd.errors import ShmInUse, UntrustedShm
from engramd.host.hugeroot import unmount_below
from engramd.host.shmfs import is_mount_point
from engramd_shared.layout import LOCK_NAME, ROOT_NAME, NotOwned, check_owned_dir, sets_root

log = logging.getLogger("engramd")

FIX_ROOT = (
    "remove it as root (rm -rf {root}) and let only engramd make it: at boot with "
    "deploy/systemd/engramd.tmpfiles.conf, in Kubernetes with the DaemonSet's init "
    "container, or point --shm-dir at a folder only engramd's user may write"
)


def check_writers(folder: str, above: bool) -> None:
    """Refuse `folder` (and with `above`, every folder above it, symlinks resolved) where
    others than its owner may write without its sticky bit: its group's members or every
    user could rename engramd's folder away and put another in its place."""
    real = Path(os.path.realpath(folder))
    for where in [real, *real.parents] if above else [Path(folder)]:
        st = os.stat(where)
        mode = stat.S_IMODE(st.st_mode)
        if not mode & (stat.S_IWGRP | stat.S_IWOTH) or mode & stat.S_ISVTX:
            continue
        who = "every user" if mode & stat.S_IWOTH else f"the members of its group (gid {st.st_gid})"
        raise UntrustedShm(
            f"{where} may be written by {who} (mode {mode:04o}) and has no sticky bit, so they "
            f"could replace engramd's folder in {folder}; use a folder only engramd's user may "
            f"write: `chmod go-w {where}` (or sticky: `chmod +t {where}`)"
        )


def claim_root(shm_dir: str, gid: int | None, above: bool = False) -> Path:
    """`<shm_dir>/engramd`, a folder of the daemon's own (0750, group `gid`); made if missing.

    `shm_dir` may not be written by others than its owner unless sticky
    (/dev/shm is), nor with `above` (a disk's folder) any folder above it.
    """
    root = sets_root(shm_dir)
    uid = os.geteuid()
    check_writers(shm_dir, above)
    try:
        check_owned_dir(root, uid)
    except FileNotFoundError:
        pass
    except NotOwned as e:
        # Another user's live daemon (root may move its folder aside): never touched.
        _refuse_if_held(root)
        if is_mount_point(root):
            return _detach(shm_dir, root, gid, e)
        aside = root.with_name(f"{ROOT_NAME}.untrusted-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.rename(root, aside)
        except OSError:
            raise UntrustedShm(
                f"{e}: another user made it before engramd, and engramd may not move it "
                f"aside; {FIX_ROOT.format(root=root)}"
            ) from None
        log.error(
            "%s: another user made it before engramd; moved it aside to %s (inspect it, then "
            "remove it); nothing in it is served",
            e,
            aside,
        )
    else:
        _secure(root, gid)
        return root
    os.mkdir(root, 0o750)
    _secure(root, gid)
    # mkdir failed had someone made it again meanwhile; check what was made.
    check_owned_dir(root, uid)
    return root


def _detach(shm_dir: str, root: Path, gid: int | None, e: NotOwned) -> Path:
    """A mount over the root that is not the daemon's (a mount point cannot be moved aside)."""
    try:
        unmount_below(root)
    except OSError:
        raise UntrustedShm(
            f"{e}: a mount that is not engramd's, and engramd may not unmount it; "
            f"unmount it as root (umount {root}) and let only engramd make it"
        ) from None
    log.error("%s: a mount that is not engramd's; detached it; nothing in it is served", e)
    return claim_root(shm_dir, gid)


def _secure(root: Path, gid: int | None) -> None:
    if gid is not None:
        os.chown(root, -1, gid)
    os.chmod(root, 0o750)


class RootLock:
    """The exclusive locks one daemon holds on its sets root, for its life.

    One per view of the root: the bare folder, and the huge-page tmpfs the
    daemon may mount over it afterwards (which hides the folder's lock from
    every later daemon). `holder` says who holds it (pid, socket) to a daemon
    that finds it taken.
    """

    def __init__(self, holder: str) -> None:
        self._holder = holder
        self._fds: list[int] = []

    def take(self, root: Path) -> None:
        """Lock `root`'s lock file (made if missing); raises ShmInUse while another holds it."""
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        if any(_same_file(os.fstat(held), st) for held in self._fds):
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ShmInUse(_in_use(root, holder)) from None
        os.ftruncate(fd, 0)
        # hugetlbfs has no write(): there the kernel's lock table names the holder.
        with contextlib.suppress(OSError):
            os.pwrite(fd, f"{self._holder}\n".encode(), 0)
        self._fds.append(fd)

    def release(self) -> None:
        """Let the next daemon take the root (at shutdown; exit does it too)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _holder(fd: int) -> str:
    """Who holds the lock on `fd`'s file: what it wrote there, else its pid (/proc/locks)."""
    with contextlib.suppress(OSError):
        written = os.pread(fd, 512, 0).decode(errors="replace").strip()
        if written:
            return written
    st = os.fstat(fd)
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and file_id in fields:
                return f"pid {fields[fields.index(file_id) - 1]}"
    return ""


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _in_use(root: Path, holder: str) -> str:
    return (
        f"another engramd ({holder or 'pid unknown'}) serves the sets in {root}; one daemon per "
        "shm folder, or this one would adopt its sets and could drop them under it: stop that "
        "daemon first, or give this one a --shm-dir of its own"
    )


def _refuse_if_held(root: Path) -> None:
    """Raise ShmInUse when a live daemon holds `root`'s lock."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ShmInUse(_in_use(root, _holder(fd))) from None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
