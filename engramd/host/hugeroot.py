"""2 MiB pages for tmpfs sets by default: a tmpfs of the daemon's own over `<shm_dir>/engramd`.

/dev/shm is mounted without `huge=`, and shmem_enabled=never (the kernel's
default) keeps it on 4 KiB pages; but a tmpfs mounted with
`huge=within_size` gives 2 MiB pages whatever shmem_enabled says (except
"deny"). So where the daemon may mount (CAP_SYS_ADMIN) and its mount
namespace is the host's, it mounts such a tmpfs over its sets root while the
root holds no sets. The mount stays when the daemon exits: the next daemon
finds it, reuses it and adopts its sets, as it does in /dev/shm. A mount in
a namespace of the daemon's own would vanish with the daemon, so there it
does not mount. The sysfs knobs are the operator's: they are read and
reported, never written.

The mount is sized to the shm folder's total, and the sets in it count
against that folder's free space (see TmpfsBacking.usage): the node's shared
memory stays bounded by what the operator gave /dev/shm.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path

from engramd.host.libc import libc
from engramd.host.shmfs import (
    find_mount,
    huge_pages,
    is_mount_point,
    mounts_below,
    shmem_enabled,
    usage,
)
from engramd.units import gib
from engramd_shared.layout import LOCK_NAME

log = logging.getLogger("engramd")

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
_CAP_SYS_ADMIN = 21
#: The inode of the initial mount namespace (MNT_NS_INIT_INO, uapi linux/nsfs.h,
#: kernel 6.18 on); never an inode of another namespace, whose are 0xF0000000 and up.
_INIT_MNT_NS = 0xEFFFFFF8
#: The options that give 2 MiB pages (with the size, mode and owner added).
HUGE_OPTIONS = "huge=within_size"

#: Where the fix for sets on 4 KiB pages is written out, commands and all (the one log line
#: names it; `engramd status` shows the fix itself).
SMALL_PAGES_DOCS = "docs/operations.md#fixing-4-kib-pages"

FIX_SMALL_PAGES = (
    "for 2 MiB pages let engramd mount a huge tmpfs itself (run it as root or with "
    "CAP_SYS_ADMIN, in the host's mount namespace), mount one over {root} before it starts "
    "(mount -t tmpfs -o huge=within_size,size=<bytes>,mode=0750,uid=<engramd>,gid=<group>,"
    "nosuid,nodev,noexec tmpfs {root}), or point --shm-dir at one "
    "(deploy/systemd/srv-engramd-shm.mount); memfd sets take 2 MiB pages once "
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled is within_size (it is {knob})"
)


def small_pages_fix(root: Path) -> str:
    """The fix for new sets in `root` on 4 KiB pages, in full (what status shows)."""
    return FIX_SMALL_PAGES.format(root=root, knob=shmem_enabled())


def claim_huge_root(shm_dir: str, root: Path, gid: int | None, enabled: bool) -> str:
    """Put `root` on 2 MiB pages where the daemon may; "" when new sets there get them.

    Otherwise: why they get 4 KiB pages, in one short line (for the log and status;
    small_pages_fix is the fix).
    """
    if huge_pages(root):
        if is_mount_point(root):
            log.info("reusing the huge-page tmpfs over %s and the sets in it", root)
        return ""
    why = _why_not(shm_dir, root, enabled)
    if not why:
        why = _mount(shm_dir, root, gid)
    if not why:
        return ""
    return f"new sets in {root} get 4 KiB pages: {why}"


def _why_not(shm_dir: str, root: Path, enabled: bool) -> str:
    """Why the daemon does not mount a huge tmpfs over `root`, or ""."""
    if not enabled:
        return "the huge tmpfs is turned off (--no-huge-tmpfs)"
    knob = shmem_enabled()
    if knob == "deny":
        return "shmem_enabled is deny, which keeps every tmpfs on them"
    fstype = find_mount(root).fstype
    if fstype != "tmpfs":
        return f"the shm folder is on {fstype or 'an unknown filesystem'}, not tmpfs"
    if is_mount_point(root):
        return "it is a tmpfs mounted without huge= (remount it with huge=within_size)"
    if not _has_sys_admin():
        return "engramd may not mount one (it lacks CAP_SYS_ADMIN)"
    outside = _outside_host_namespace()
    if outside:
        return outside
    if any(p.name != LOCK_NAME for p in root.iterdir()):
        return "it holds sets of an earlier daemon that a mount would hide (drop them, restart)"
    return ""


def _has_sys_admin() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


def _outside_host_namespace() -> str:
    """Why a mount of the daemon's would not outlive it (a mount namespace of its own), or ""."""
    own = os.stat("/proc/self/ns/mnt").st_ino
    if own == _INIT_MNT_NS:
        return ""
    try:
        first = os.stat("/proc/1/ns/mnt").st_ino
    except OSError as e:
        return f"engramd cannot tell if its mount namespace is the host's ({e.strerror})"
    if own != first:
        return (
            "engramd has a private mount namespace (PrivateTmp=, ProtectSystem=, unshare): a "
            "mount would vanish with it"
        )
    if os.getpid() == 1:
        return "engramd is its container's pid 1: a mount would vanish with it"
    return ""


def _mount(shm_dir: str, root: Path, gid: int | None) -> str:
    """Mount the huge tmpfs over `root`; "" on success, else why it failed."""
    size = usage(shm_dir).total
    owner = f"mode=0750,uid={os.geteuid()},gid={os.getegid() if gid is None else gid}"
    options = f"{HUGE_OPTIONS},size={size},{owner}"
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if libc.mount(b"tmpfs", os.fsencode(root), b"tmpfs", flags, options.encode()) != 0:
        return f"mounting a huge tmpfs over it failed ({os.strerror(ctypes.get_errno())})"
    log.info(
        "mounted a tmpfs with 2 MiB pages over %s (%s, %s, the shm folder's total); it stays "
        "after engramd exits, so a restart adopts its sets",
        root,
        HUGE_OPTIONS,
        gib(size),
    )
    return ""


def unmount_below(folder: str | os.PathLike[str]) -> None:
    """Detach every mount at or under `folder` (a huge root engramd made), deepest first.

    For whoever removes a shm folder after the daemon (tests, the demo, the
    benchmark): lazily, so a worker that still maps a set keeps its pages.
    """
    for point in mounts_below(folder):
        if libc.umount2(os.fsencode(point), _MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {point}: {os.strerror(err)}")


def remove_shm_folder(folder: str | os.PathLike[str]) -> None:
    """Remove a shm folder a daemon used: its huge root unmounted first, then every file."""
    unmount_below(folder)
    shutil.rmtree(folder, ignore_errors=True)
