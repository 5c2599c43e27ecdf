"""The daemon's own folder in the shm folder: made by it, or refused.

In /dev/shm every user may create `engramd/` before the daemon does (after a
reboot, say) and then rename or replace what the daemon puts inside. So the
daemon uses `<shm_dir>/engramd` only when it is a real folder that the
daemon's user owns and nobody else may write. Anything else there is moved
aside with a log line when the daemon may do so (as root), a mount that is
not the daemon's is detached, or the start fails, naming the fix. Workers
check the same ownership before they map.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from engramd.errors import UntrustedShm
from engramd.host.hugeroot import unmount_below
from engramd.host.shmfs import is_mount_point
from engramd_shared.layout import ROOT_NAME, NotOwned, check_owned_dir, sets_root

log = logging.getLogger("engramd")

FIX_ROOT = (
    "remove it as root (rm -rf {root}) and let only engramd make it: at boot with "
    "deploy/systemd/engramd.tmpfiles.conf, in Kubernetes with the DaemonSet's init "
    "container, or point --shm-dir at a folder only engramd's user may write"
)


def claim_root(shm_dir: str, gid: int | None) -> Path:
    """`<shm_dir>/engramd`, a folder of the daemon's own (0750, group `gid`); made if missing."""
    root = sets_root(shm_dir)
    uid = os.geteuid()
    parent = os.stat(shm_dir)
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        raise UntrustedShm(
            f"{shm_dir} may be written by every user and has no sticky bit, so anyone could "
            "replace engramd's folder in it; use a folder only engramd's user may write "
            "(or /dev/shm, which is sticky)"
        )
    try:
        check_owned_dir(root, uid)
    except FileNotFoundError:
        pass
    except NotOwned as e:
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
