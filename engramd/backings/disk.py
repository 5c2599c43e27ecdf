"""Sets as files on a local disk (`--backing disk`, `--disk-dir`): tables larger than memory.

The tmpfs layout and lifecycle (engramd.backings.tmpfs) on a disk file system
the operator names (an NVMe's): a `.loading-*` folder renamed once complete,
read-only mappings by descriptor or path, adoption at start. What a disk
changes:

- the set is the page cache's: never locked (--mlock does not apply), its
  pages evicted under memory pressure and read back from the disk at the next
  fault, in the daemon and in every worker; status shows the bytes resident;
- the daemon reads a ready or adopted set into the page cache once, within the
  memory the node can spare (`warm`, engramd.host.pagewarm), so engines that
  start later find it cached;
- files are written once, by the daemon, and then read-only to everyone:
  0400 until the operator publishes the set, 0440 after; `<disk_dir>/engramd`
  is the daemon's (0750), in a folder where no one else may replace it
  (shmroot.claim_root: neither it nor a folder above it writable by its group
  or by all, unless sticky);
- a load is durable before it is published: the files, then the manifest,
  then the renamed folder reach the disk (fsync) in that order, so a power
  loss leaves a `.loading-*` folder (removed at the next start) or a whole set;
- adoption after a restart or a reboot reads no table byte: the folder and
  every file are the daemon's own and writable by no one else (layout's
  ownership checks), every file is at its full size, and none was modified
  after its manifest was written (each file is fsynced before the manifest
  is made: a later write leaves a file's mtime past the manifest's). Only
  root or the daemon's user can get past that; `engramd verify` reads
  every byte against the manifest's checksums;
- a file cut short (root's truncate) is refused at the next attach and the
  copy marked failed verification: a worker's mapping would fault past the
  file's end.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import threading
from pathlib import Path
from typing import ClassVar

from engramd.backings.base import Usage
from engramd.backings.tmpfs import TmpfsBacking
from engramd.config import DaemonConfig
from engramd.errors import ShmOnDisk
from engramd.host.fdstore import FdStore
from engramd.host.pagecache import resident_bytes
from engramd.host.pagesize import PageCensus
from engramd.host.pagewarm import Span, Warmed, warm
from engramd.host.pinning import PinnedFiles
from engramd.host.shmfs import usage
from engramd_shared.layout import Manifest, open_owned, set_dir

log = logging.getLogger("engramd")

#: File systems whose bytes others (another host) may change under the daemon's manifest.
_SHARED_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "9p", "virtiofs", "ceph", "glusterfs", "lustre",
        "gpfs", "beegfs", "ocfs2", "gfs2", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse",
        "fuse.juicefs", "fuse.ceph-fuse",
    }
)  # fmt: skip


class DiskBacking(TmpfsBacking):
    """Files under `<disk_dir>/engramd/`, one per tensor, group `gid`, read-only once written."""

    name: ClassVar[str] = "disk"
    writable_descriptors = False
    lockable = False
    warmable = True
    private_mode = 0o400
    shared_mode = 0o440
    folder_kind = "the disk folder"
    space_fix = "free space on that disk, drop unused sets, or point --disk-dir at a larger disk"

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> DiskBacking:
        """Files under `config.disk_dir`."""
        holder = f"pid {os.getpid()}, socket {config.socket}"
        return cls(config.disk_dir, gid, allow_disk=True, huge_tmpfs=False, holder=holder)

    def claim(self) -> None:
        """Take the folder as tmpfs does; a folder this user may not write says whose it is."""
        try:
            super().claim()
        except PermissionError as e:
            raise PermissionError(_not_writable(self.shm_dir, e)) from None

    def _accept_filesystem(self, fstype: str) -> None:
        """Any local file system; a network one is refused."""
        if fstype in _SHARED_FILESYSTEMS:
            raise ShmOnDisk(
                f"--disk-dir {self.shm_dir} is on {fstype}, a network file system: other "
                "machines could change the tables under the daemon's checksums; point "
                "--disk-dir at a local disk's folder (an NVMe's)"
            )
        self.disk_filesystem = fstype or "unknown"

    def usage(self) -> Usage:
        """The file system's sizes; its page size is the page cache's."""
        u = usage(self.shm_dir)
        return Usage(f"{u.dir} (disk, {self.disk_filesystem})", u.total, u.used, u.free, 4096)

    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        """Never: the set's pages are the page cache's to evict (lockable is False)."""
        raise NotImplementedError("a disk-backed set is never locked in memory")

    def page_census(self, manifest: Manifest) -> PageCensus | None:
        """None: a census touches a byte of every 2 MiB, which on a disk reads it in."""
        return None

    def resident(self, manifest: Manifest) -> int | None:
        """Bytes of the set's tensors in the page cache now (no page read in)."""
        folder = set_dir(self.shm_dir, manifest.copy)
        total = 0
        for t in manifest.tensors:
            fd = open_owned(folder / t.file, self._owner)
            try:
                total += resident_bytes(fd, t.offset, t.nbytes)
            finally:
                os.close(fd)
        return total

    def warm(self, manifest: Manifest, stop: threading.Event) -> Warmed:
        """Read the set's tensors into the page cache within free memory (engramd.host.pagewarm)."""
        folder = set_dir(self.shm_dir, manifest.copy)
        opened: list[int] = []
        try:
            spans = []
            for t in manifest.tensors:
                opened.append(open_owned(folder / t.file, self._owner))
                spans.append(Span(opened[-1], t.offset, t.nbytes))
            return warm(spans, stop)
        finally:
            for fd in opened:
                os.close(fd)


def _not_writable(disk_dir: str, e: PermissionError) -> str:
    """Which user may not write which folder (its owner and mode), and the fix."""

    place = Path(e.filename or disk_dir)
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        st = place.stat()
        owner = pwd.getpwuid(st.st_uid).pw_name
        found = f"{place} is {owner}'s, mode {stat.S_IMODE(st.st_mode):04o}"
    except (OSError, KeyError):
        found = f"{place} cannot be read"
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return (
        f"--disk-dir {disk_dir}: engramd runs as {user} (uid {uid}), which may not write there "
        f"({found}); give the folder to that user (install -d -m 0750 -o {user} {disk_dir}, "
        f"or chown {user} {disk_dir}), or point --disk-dir at a folder it owns"
    )
