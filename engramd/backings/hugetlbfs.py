"""Sets on a hugetlbfs mount (2 MiB or 1 GiB pages): the tmpfs layout, packed, written by mapping.

A `--shm-dir` on hugetlbfs is detected by its filesystem (engramd.backings).
Everything a tmpfs set has holds: crash-safe loads (a `.loading-*` folder
renamed once complete), read-only mappings by descriptor or path, adoption
after a restart. What hugetlbfs changes:

- no write(2): the loader's writes go through a shared mapping of the file;
- files take whole huge pages: a set is packed into one file (`tables`),
  tensors at 4 KiB-aligned offsets, so a 32 MiB scale tensor shares a page
  with its neighbours instead of taking a 1 GiB page of its own; its
  manifest sits at the end of the last page (layout.TRAILER);
- mappings start at huge-page boundaries: workers and the pinning align
  their offsets down to the file's block size (the page size);
- capacity is the pool of free huge pages of that size (and the mount's
  size= limit), judged before a byte is copied: a set never meets an empty
  pool halfway, in the daemon or a worker (no SIGBUS).
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import ClassVar

from engramd.backings.base import StagedSet, Usage
from engramd.backings.handles import HandleKind
from engramd.backings.tmpfs import TmpfsBacking
from engramd.config import DaemonConfig
from engramd.errors import UntrustedShm
from engramd.host.fdstore import FdStore
from engramd.host.hugepages import MappedWriter, Pool, fs_page_size, pool
from engramd.host.reserve import reserve_files
from engramd.host.shmfs import mount_of
from engramd.units import gib
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import (
    PACKED_NAME,
    Manifest,
    extents,
    packed_offsets,
    packed_tensors,
    sets_root,
    trailer,
)


def manifest_room(ntensors: int) -> int:
    """Bytes kept at the end of a packed file for its manifest and trailer.

    A tensor's entry and its file's (at most one per tensor) take a few
    hundred bytes unless their names are extreme; 8 KiB each is ample.
    """
    return (64 << 10) + (8 << 10) * ntensors


class HugetlbfsBacking(TmpfsBacking):
    """Packed set files on a hugetlbfs mount, 0640, group `gid`."""

    name: ClassVar[str] = "hugetlbfs"
    handle_kinds = frozenset({HandleKind.SHM, HandleKind.FD})

    def __init__(self, shm_dir: str, gid: int | None, node: int | None = None) -> None:
        super().__init__(shm_dir, gid)
        self.page_size = fs_page_size(shm_dir)
        #: Pages come from this NUMA node's pool (--numa node:N), else from any.
        self.node = node

    @classmethod
    def from_config(
        cls, config: DaemonConfig, gid: int | None, fd_store: FdStore
    ) -> HugetlbfsBacking:
        """Files under `config.shm_dir`, which must be a hugetlbfs mount."""
        return cls(config.shm_dir, gid, config.numa.node)

    def claim(self) -> None:
        """Refuse a shm folder that is not on hugetlbfs; then as tmpfs."""
        fstype, _ = mount_of(self.shm_dir)
        if fstype != "hugetlbfs":
            raise UntrustedShm(
                f"--backing hugetlbfs needs --shm-dir on a hugetlbfs mount; {self.shm_dir} is on "
                f"{fstype or 'an unknown filesystem'} (mount -t hugetlbfs -o pagesize=1G none DIR)"
            )
        super().claim()

    def _bounds(self, node: int | None = None) -> tuple[Pool, int, int]:
        """(the pool, total, free): the pool of the mount's page size, tightened by size=.

        The pool of `node` (a copy kept per node), else of the --numa node:N, else of all.
        """
        p = pool(self.page_size, self.memory_node(node))
        st = os.statvfs(self.shm_dir)
        total, free = p.total, p.free
        if st.f_blocks:  # mounted with size=
            total = min(total, st.f_blocks * st.f_frsize)
            free = min(free, st.f_bavail * st.f_frsize)
        return p, total, free

    def usage(self) -> Usage:
        """The pool of huge pages of the mount's size, tightened by its size= limit."""
        _, total, free = self._bounds()
        used = sum(
            f.stat().st_size
            for folder in sets_root(self.shm_dir).glob("*")
            for f in folder.glob("*")
            if f.is_file()
        )
        return Usage(self.shm_dir, total, used, free, self.page_size)

    def footprint(self, sizes: list[int]) -> int:
        """One packed file: the tensors' places, the manifest's room, in whole huge pages."""
        _, end = packed_offsets(sizes)
        return self.reserved(end + manifest_room(len(sizes)))

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Refuse a set beyond the pool (or the mount), or its free pages plus `reclaimable`."""
        p, total, free = self._bounds(node)
        if needed > total:
            raise ShmCapacityError(
                f"{what} needs {gib(needed)} of {gib(self.page_size)} huge pages but "
                f"{self.shm_dir} can have {gib(total)} in all; {p.fix(needed)}"
            )
        if needed > free + reclaimable:
            raise ShmCapacityError(
                f"{what} needs {gib(needed)} of {gib(self.page_size)} huge pages but "
                f"{gib(free)} are free for {self.shm_dir}; drop unused sets or "
                f"{p.fix(needed + total - free)}"
            )

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        """A `.loading-*` folder with the packed file's pages allocated and mapped."""
        return _StagedPacked(self, plan, self.memory_node(node))


class _StagedPacked(StagedSet):
    def __init__(self, backing: HugetlbfsBacking, plan: TablePlan, node: int | None) -> None:
        self._backing = backing
        self._plan = plan
        self._folder = backing.loading_folder(plan.set_id)
        self._offsets, self._end = packed_tensors(plan.tensors)
        self._size = backing.footprint(extents(plan.tensors))
        self._fd = -1
        self._writer: MappedWriter | None = None
        try:
            backing.make_folder(self._folder)
            self._fd = backing.make_file(self._folder / PACKED_NAME)
            try:
                # Every huge page now, on every core: an empty pool fails here,
                # never as a SIGBUS at the first touch of a page.
                reserve_files([(self._fd, self._size)], backing.page_size, hugetlb=True)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise ShmCapacityError(
                    f"the pool of {gib(backing.page_size)} huge pages ran out while reserving "
                    f"{gib(self._size)} for set {plan.set_id} (another user took pages after "
                    f"the capacity check?); {pool(backing.page_size, node).fix(self._size)}"
                ) from None
            self._writer = MappedWriter(self._fd, self._size)
        except BaseException:
            self.discard()
            raise

    def placement(self, index: int) -> tuple[str, int]:
        """Every tensor in the one packed file."""
        return PACKED_NAME, self._offsets[index]

    def memory(self, index: int) -> tuple[int, int]:
        """The one packed file, at the tensor's offset."""
        return self._fd, self._offsets[index]

    def write(self, index: int, data: memoryview, offset: int) -> None:
        """Copy into the mapping (hugetlbfs has no write())."""
        assert self._writer is not None
        self._writer.write(data, self._offsets[index] + offset)

    def publish(self, manifest: Manifest) -> None:
        """Put the manifest at the end of the file, then rename the folder to the copy's name."""
        assert self._writer is not None
        tail = trailer(manifest.to_json().encode())
        room = self._size - self._end
        if len(tail) > room:
            raise ShmCapacityError(
                f"the manifest of set {manifest.set_id} ({len(tail)} bytes) does not fit the "
                f"{room} bytes kept for it; report this with the checkpoint's layout"
            )
        self._writer.write(tail, self._size - len(tail))
        self._close()
        os.rename(self._folder, self._folder.with_name(manifest.copy))

    def discard(self) -> None:
        """Remove the `.loading-*` folder; its pages return to the pool."""
        self._close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
