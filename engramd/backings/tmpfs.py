"""Sets as files in a tmpfs folder (`--shm-dir`), the layout of engramd_shared.layout.

A tmpfs mounted with `huge=within_size` backs the files with 2 MiB pages: the
daemon mounts one over its sets root where it may (engramd.host.hugeroot).
Sets survive a daemon restart; workers get read-only descriptors over the
fd channel, or open the files by path (checked by owner, mode and the
manifest's nonce) where they share the daemon's /dev/shm.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import shutil
from pathlib import Path
from typing import ClassVar

from engramd.backings.base import Backing, StagedSet, Usage
from engramd.backings.handles import Handle, HandleKind, PathRange
from engramd.config import DaemonConfig
from engramd.errors import ShmOnDisk
from engramd.host.fdstore import FdStore
from engramd.host.hugeroot import SMALL_PAGES_DOCS, claim_huge_root, small_pages_fix
from engramd.host.pinning import PinnedFiles
from engramd.host.reserve import reserve_files
from engramd.host.shmfs import huge_pages, is_mount_point, mount_of, usage, whole_huge_pages
from engramd.host.shmroot import RootLock, claim_root
from engramd.strong import digest_fd_as
from engramd.units import gib
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import (
    LOADING_MARK,
    LOCK_NAME,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    check_complete,
    is_copy_name,
    lead,
    open_owned,
    read_manifest,
    set_dir,
    sets_root,
    tensor_file_name,
)

log = logging.getLogger("engramd")

FIX_SHM_SIZE = (
    "give the daemon a larger /dev/shm (docker run --shm-size=<bytes> or --ipc=host; "
    "in Kubernetes a memory-backed emptyDir at /dev/shm with a sizeLimit), "
    "or point --shm-dir at a tmpfs sized for the tables"
)
_SMALL_PAGE = 4096
_HUGE_PAGE = 2 << 20
#: Filesystems that keep a set's pages in memory, never on a disk.
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs"})


class TmpfsBacking(Backing):
    """Files under `<shm_dir>/engramd/`, one per tensor, group `gid`.

    A set's files are owner-only (0600) until the operator publishes it
    (share_with_group makes them 0640): the socket group reads by path
    only what any member may attach; other sets go out as descriptors over
    the fd channel, which knows the peer's uid.
    """

    name: ClassVar[str] = "tmpfs"
    handle_kinds = frozenset({HandleKind.SHM, HandleKind.FD})
    writable_descriptors = True
    #: A set's files until the operator publishes it, and after (share_with_group).
    private_mode: ClassVar[int] = 0o600
    shared_mode: ClassVar[int] = 0o640
    #: What the folder is called in errors, and how to give it more room.
    folder_kind: ClassVar[str] = "the shm folder"
    space_fix: ClassVar[str] = FIX_SHM_SIZE

    def __init__(
        self,
        shm_dir: str,
        gid: int | None,
        allow_disk: bool = False,
        huge_tmpfs: bool = False,
        holder: str = "",
    ) -> None:
        """Sets under `shm_dir`; `holder` names this daemon to one that finds the folder taken."""
        self.shm_dir = shm_dir
        self._gid = gid
        self._owner = os.geteuid()
        self._allow_disk = allow_disk
        self._huge_tmpfs = huge_tmpfs
        self._set_page_size(Path(shm_dir))
        #: The shm folder's filesystem where it is a disk's (accepted by the operator), else "".
        self.disk_filesystem = ""
        #: The tmpfs mounted over the sets root that holds the sets, or None (the shm folder).
        self._root_mount: Path | None = None
        #: Its sets also count against the shm folder's free space.
        self._counted_in_shm = False
        self._lock = RootLock(holder or f"pid {os.getpid()}")

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> TmpfsBacking:
        """Files under `config.shm_dir`, on a huge-page tmpfs of the daemon's where it may."""
        holder = f"pid {os.getpid()}, socket {config.socket}"
        return cls(config.shm_dir, gid, config.allow_disk_backed_tables, config.huge_tmpfs, holder)

    def _set_page_size(self, folder: Path) -> None:
        self.page_size = _HUGE_PAGE if huge_pages(folder) else _SMALL_PAGE
        # tmpfs charges whole huge pages only where even a file's tail gets one.
        self._unit = _HUGE_PAGE if whole_huge_pages(folder) else _SMALL_PAGE

    @property
    def survives_restart(self) -> bool:
        """tmpfs files stay until they are unlinked (or the node reboots)."""
        return True

    def claim(self) -> None:
        """Make the shm folder where missing; refuse a disk's unless accepted; make or check
        `<shm_dir>/engramd` (shmroot); put it on 2 MiB pages where the daemon may (hugeroot)."""
        folder = Path(self.shm_dir)
        if not folder.exists():
            folder.mkdir(parents=True, exist_ok=True)
            # Its group must pass through it to the sets, whatever the umask.
            self.secure_folder(folder)
        self._accept_filesystem(mount_of(self.shm_dir)[0])
        # A disk's folder (--disk-dir) lives among the operator's: every folder above it counts.
        root = claim_root(self.shm_dir, self._gid, above=self.name == "disk")
        # Before anything in it is adopted, changed or mounted over.
        self._lock.take(root)
        if self.disk_filesystem or self.name != TmpfsBacking.name:
            return
        self._claim_huge_root(root)

    def _accept_filesystem(self, fstype: str) -> None:
        """Refuse a shm folder on a disk, unless the operator accepted it."""
        if fstype not in _MEMORY_FILESYSTEMS:
            if not self._allow_disk:
                # Tables there are written to the disk and read through the
                # page cache, which the kernel may evict: slow loads, faults
                # that wait on the disk, and no shared-memory guarantees.
                raise ShmOnDisk(
                    f"--shm-dir {self.shm_dir} is on {fstype or 'an unknown filesystem'}, not "
                    "tmpfs or hugetlbfs: the tables would go to disk and the page cache; point "
                    "--shm-dir at a tmpfs (/dev/shm, or mount -t tmpfs -o size=<bytes> tmpfs "
                    "DIR), use --backing memfd, or accept it with --allow-disk-backed-tables"
                )
            self.disk_filesystem = fstype or "unknown"
            log.warning(
                "--shm-dir %s is on %s, a disk filesystem (--allow-disk-backed-tables): the "
                "tables go to disk and are served from the page cache",
                self.shm_dir,
                self.disk_filesystem,
            )

    def _claim_huge_root(self, root: Path) -> None:
        self.small_pages_reason = claim_huge_root(self.shm_dir, root, self._gid, self._huge_tmpfs)
        # A tmpfs mounted over the root just now hides the folder's lock from later daemons.
        self._lock.take(root)
        if self.small_pages_reason:
            self.small_pages_fix = small_pages_fix(root)
            # Asked for with --no-huge-tmpfs: said, not warned about. One short line: the
            # fix, commands and all, is in status and the docs.
            (log.warning if self._huge_tmpfs else log.info)(
                "%s; the fix: engramd status, %s", self.small_pages_reason, SMALL_PAGES_DOCS
            )
        if is_mount_point(root):
            self._root_mount = root
            # engramd sizes its mount to the shm folder's total and counts its sets
            # against that folder; a mount of another size is the operator's own budget.
            self._counted_in_shm = usage(root).total == usage(self.shm_dir).total
        self._set_page_size(root)

    @property
    def durable(self) -> bool:
        """Files and manifest reach the disk before a set is published: a folder on a disk
        (its sets outlive a reboot, and are adopted after one); a tmpfs's die with the boot."""
        return bool(self.disk_filesystem)

    def release(self) -> None:
        """Let the next daemon take the shm folder."""
        self._lock.release()

    def usage(self) -> Usage:
        """The tmpfs's sizes and the page size of its new files.

        With a tmpfs mounted over the sets root, the sizes are that mount's; the
        one engramd mounts (sized to the shm folder's total) also counts its
        sets against the shm folder: free is what both have left.
        """
        u = usage(self.shm_dir)
        if self._root_mount is not None:
            r = usage(self._root_mount)
            free = min(r.free, max(u.free - r.used, 0)) if self._counted_in_shm else r.free
            return Usage(u.dir, r.total, r.used, free, self.page_size)
        where = u.dir
        if self.disk_filesystem:
            where += f" (on {self.disk_filesystem}, a disk: --allow-disk-backed-tables)"
        return Usage(where, u.total, u.used, u.free, self.page_size)

    def over_shm_budget(self) -> bool:
        """engramd's mount holds more than the shm folder has left beside it (usage)."""
        if self._root_mount is None or not self._counted_in_shm:
            return False
        return usage(self._root_mount).used > usage(self.shm_dir).free

    def reserved(self, nbytes: int) -> int:
        """Bytes of `nbytes` as tmpfs charges them: 4 KiB pages, or whole huge pages (huge=always).

        hugetlbfs (a subclass) charges whole pages of its own size.
        """
        unit = self._unit if self.name == TmpfsBacking.name else self.page_size
        return -(-nbytes // unit) * unit

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Refuse a set larger than the tmpfs in all, or than its free space plus `reclaimable`."""
        u = self.usage()
        if needed > u.total:
            raise ShmCapacityError(
                f"{what} needs {gib(needed)} but {self.folder_kind} {u.where} holds "
                f"{gib(u.total)} in all; {self.space_fix}"
            )
        if needed > u.free + reclaimable:
            raise ShmCapacityError(
                f"{what} needs {gib(needed)} but {self.folder_kind} {u.where} has "
                f"{gib(u.free)} free of {gib(u.total)}; drop unused sets or {self.space_fix}"
            )

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        """A `.loading-*` folder with every tensor file reserved to its full size."""
        return _StagedFolder(self, plan)

    def loading_folder(self, set_id: str) -> Path:
        """The path of a new load's folder: never a copy's name, unique to this load."""
        return (
            sets_root(self.shm_dir) / f"{set_id}{LOADING_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        )

    def make_folder(self, folder: Path) -> None:
        """Create `folder` (not there before), 0750, group `gid`."""
        folder.mkdir(mode=0o750)
        self.secure_folder(folder)

    def secure_folder(self, folder: Path) -> None:
        """Give a folder the daemon made 0750 and group `gid`."""
        # mkdir's mode passes through the umask (077 would shut the group out).
        os.chmod(folder, 0o750)
        if self._gid is not None:
            os.chown(folder, -1, self._gid)

    def make_file(self, path: Path) -> int:
        """Create `path` (not there before), `private_mode`, group `gid`; a read-write
        descriptor.

        The group may read it once the operator publishes its set (share_with_group).
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.private_mode)
        # Explicitly: open's mode passes through the umask.
        os.fchmod(fd, self.private_mode)
        if self._gid is not None:
            os.fchown(fd, -1, self._gid)
        return fd

    def adopt(self) -> list[Manifest]:
        """Complete sets of the daemon's own; partial loads and anything else are removed."""
        found = []
        for folder in sorted(sets_root(self.shm_dir).iterdir()):
            if folder.name == LOCK_NAME:
                continue
            if LOADING_MARK in folder.name:
                log.info("removing partial load %s", folder)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            try:
                if not is_copy_name(folder.name):
                    raise ManifestError("not a set folder")
                manifest = read_manifest(folder, self._owner)
                check_complete(folder, manifest, self._owner)
                self._check_unchanged(folder, manifest)
                # Published again only by the operator: an earlier daemon's modes do not stand.
                self._set_mode(manifest, self.private_mode)
            except (OSError, ManifestError) as e:
                log.warning("removing %s: not a complete set of engramd's own (%s)", folder, e)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            found.append(manifest)
        return found

    def _check_unchanged(self, folder: Path, manifest: Manifest) -> None:
        """On a disk (durable), raise ManifestError where a file was modified after the
        manifest was written: each file is fsynced before the manifest is made, so a later
        write leaves a later mtime. A tmpfs's files live no longer than the boot."""
        if not self.durable:
            return
        written = os.stat(folder / MANIFEST_NAME).st_mtime_ns
        for file in dict.fromkeys(t.file for t in manifest.tensors):
            modified = os.stat(folder / file).st_mtime_ns
            if modified > written:
                raise ManifestError(
                    f"{file} was modified after its manifest was written (mtime "
                    f"{modified} ns > {written} ns); load the set again"
                )

    def damage(self, manifest: Manifest) -> list[str]:
        """The set's files cut short since it was published (a worker's mapping would fault
        past a file's end); none when they are whole. A file that is gone or not the
        daemon's is the handles' to refuse (SegmentNotVisible), not damage."""
        folder = set_dir(self.shm_dir, manifest.copy)
        found = []
        for t in manifest.tensors:
            try:
                fd = open_owned(folder / t.file, self._owner)
            except (OSError, ManifestError):
                continue
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size < t.offset + t.nbytes:
                found.append(
                    f"tensor {t.name!r}: {t.file} is {size} bytes, manifest says at least "
                    f"{t.offset + t.nbytes} (cut short since it was published)"
                )
        return found

    def share_with_group(self, manifest: Manifest) -> None:
        """Give the set's files `shared_mode`: the socket group may map them by path."""
        self._set_mode(manifest, self.shared_mode)

    def _set_mode(self, manifest: Manifest, mode: int) -> None:
        folder = set_dir(self.shm_dir, manifest.copy)
        files = dict.fromkeys(t.file for t in manifest.tensors)
        if (folder / MANIFEST_NAME).exists():
            # Its own file here (hugetlbfs packs it into the set's file): it names
            # the checkpoint, which status shows only to those who may read it.
            files[MANIFEST_NAME] = None
        for file in files:
            fd = open_owned(folder / file, self._owner)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def _path(self, manifest: Manifest, index: int) -> Path:
        return set_dir(self.shm_dir, manifest.copy) / manifest.tensors[index].file

    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        """Map the tensor's range of its file read-only and lock it."""
        t = manifest.tensors[index]
        pins.pin(self._path(manifest, index), t.offset, t.nbytes)

    def checksum(self, manifest: Manifest, index: int, like: str = "") -> str:
        """The digest, of the kind `like` names (the manifest's checksum's by default), of the
        tensor's file as it is now ("short" when it is shorter)."""
        t = manifest.tensors[index]
        with open(open_owned(self._path(manifest, index), self._owner), "rb") as f:
            return digest_fd_as(f.fileno(), t.offset, t.nbytes, like or t.checksum)

    def remove(self, copy: str) -> None:
        """Unlink the copy's folder."""
        shutil.rmtree(set_dir(self.shm_dir, copy), ignore_errors=True)

    def handles(self, manifest: Manifest, kind: HandleKind) -> list[Handle]:
        """Descriptors (HandleKind.FD), or paths (HandleKind.SHM) valid in the daemon's mounts."""
        if kind is HandleKind.FD:
            return self.fd_handles(manifest)
        folder = set_dir(self.shm_dir, manifest.copy)
        return [
            Handle(
                t.name,
                t.dtype,
                t.shape,
                PathRange(str(folder / t.file), t.offset, t.nbytes, str(folder)),
            )
            for t in manifest.tensors
        ]

    def mapped_as(self, copy: str) -> str:
        """The copy's folder: every file of it is mapped by its path."""
        return f"{set_dir(self.shm_dir, copy)}/"

    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        """Each tensor file, opened read-only once it proved to be the daemon's own.

        `writable`: then opened again read-write through that descriptor (the
        daemon owns the file), for --allow-writable-gpu-mappings.
        """
        folder = set_dir(self.shm_dir, manifest.copy)
        opened: list[tuple[str, int]] = []
        try:
            for file in dict.fromkeys(t.file for t in manifest.tensors):
                owned = open_owned(folder / file, self._owner)
                if not writable:
                    opened.append((file, owned))
                    continue
                try:
                    opened.append(
                        (file, os.open(f"/proc/self/fd/{owned}", os.O_RDWR | os.O_CLOEXEC))
                    )
                finally:
                    os.close(owned)
        except BaseException:
            for _, fd in opened:
                os.close(fd)
            raise
        return opened


class _StagedFolder(StagedSet):
    def __init__(self, backing: TmpfsBacking, plan: TablePlan) -> None:
        self._backing = backing
        self._plan = plan
        self._folder = backing.loading_folder(plan.set_id)
        self._fds: list[int] = []
        self._leads = [0 if backing.durable else lead(t) for t in plan.tensors]
        try:
            backing.make_folder(self._folder)
            for i in range(len(plan.tensors)):
                self._fds.append(backing.make_file(self._folder / tensor_file_name(i)))
            # On several threads (reserve.py chooses how): allocating 4 KiB pages costs
            # ~0.25 s a GiB of one core.
            try:
                reserve_files(
                    [
                        (fd, at + t.nbytes)
                        for fd, at, t in zip(self._fds, self._leads, plan.tensors, strict=True)
                    ],
                    mmap.PAGESIZE,
                    on_disk=backing.durable,
                )
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise self._ran_out() from None
            if backing.over_shm_budget():
                # engramd's own mount did not run out, but the shm folder it counts against did.
                raise self._ran_out()
        except BaseException:
            self.discard()
            raise

    def _ran_out(self) -> ShmCapacityError:
        return ShmCapacityError(
            f"{self._backing.folder_kind} {self._backing.shm_dir} ran out of space while "
            f"reserving {gib(self._plan.nbytes)} for set {self._plan.set_id} (another writer "
            f"took the space after the capacity check?); {self._backing.space_fix}"
        )

    def placement(self, index: int) -> tuple[str, int]:
        """Each tensor in a file of its own, at its lead (on a disk at 0: its readers take
        the file as the tensor)."""
        return tensor_file_name(index), self._leads[index]

    def memory(self, index: int) -> tuple[int, int]:
        """The tensor's own reserved file, at its lead; none on a disk (durable)."""
        if self._backing.durable:
            # A store through a mapping that the disk cannot take (an I/O error, a
            # copy-on-write file system out of space) is a SIGBUS in the daemon;
            # write(2) returns the error.
            raise NotImplementedError("a set on a disk is written with write(2), never mapped")
        return self._fds[index], self._leads[index]

    def write(self, index: int, data: memoryview, offset: int) -> None:
        """Positional writes into the reserved file."""
        at = self._leads[index] + offset
        done = 0
        while done < len(data):
            done += os.pwrite(self._fds[index], data[done:], at + done)

    def publish(self, manifest: Manifest) -> None:
        """Write the manifest last, then rename the folder to the copy's name (on a durable
        backing, each step on the disk before the next)."""
        durable = self._backing.durable
        try:
            if durable:
                for fd in self._fds:
                    os.fsync(fd)
            with os.fdopen(self._backing.make_file(self._folder / MANIFEST_NAME), "w") as f:
                f.write(manifest.to_json())
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            if durable:
                # The folder's entries (the files, the manifest) before the name that
                # makes them a set.
                _sync_folder(self._folder)
            os.rename(self._folder, self._folder.with_name(manifest.copy))
            # Removed by discard if what follows fails: a set never outlives a failed load.
            self._folder = self._folder.with_name(manifest.copy)
            if durable:
                _sync_folder(self._folder.parent)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # Only the folder and the manifest are not reserved up front.
            raise ShmCapacityError(
                f"{self._backing.folder_kind} {self._backing.shm_dir} ran out of space while "
                f"loading set {manifest.set_id} ({gib(manifest.nbytes)}; another writer took "
                f"the space?); {self._backing.space_fix}"
            ) from None
        finally:
            self._close()

    def discard(self) -> None:
        """Remove the `.loading-*` folder."""
        self._close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
