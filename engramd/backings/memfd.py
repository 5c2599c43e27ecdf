"""Sets in sealed memfds: not bounded by /dev/shm, unchangeable once published.

One memfd per set holds every tensor (each at a page-aligned offset), one
more holds its manifest. The loader fills them like tmpfs files; at publish
both are sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_SEAL), so
no holder of a descriptor, root included, can change a byte or shrink the
file under a worker's mapping (no SIGBUS). Workers get read-only descriptors
over the fd channel; there is no path to open.

A memfd lives while a descriptor or a mapping of it does. The daemon keeps
the descriptors; under systemd it also hands them to the fd store
(fdstore.py) and the next daemon adopts them. Without a store a restart
reloads, and workers keep reading the copy they map.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import ClassVar

from engramd.backings.base import Backing, StagedSet, Usage
from engramd.backings.handles import Handle, HandleKind
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.hugepages import MEMFD_PAGE_SIZES, MappedWriter, pool
from engramd.host.memlimit import check_memory, memory_limit, page_size_of_memfd
from engramd.host.pinning import PinnedFiles
from engramd.host.reserve import reserve_files
from engramd.host.shmfs import shmem_enabled
from engramd.strong import digest_fd_as
from engramd.units import gib
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import (
    Manifest,
    ManifestError,
    copy_name,
    extents,
    lead,
    packed_offsets,
    packed_tensors,
)

log = logging.getLogger("engramd")

#: What a published set's memfds carry: nothing can change their bytes or size.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
#: The file name of a set's tables in its manifest, the fd channel and the fd store.
TABLES = "tables"
MANIFEST = "manifest"
FIX_MEMORY = (
    "raise the daemon's memory limit (systemd MemoryMax=, the container's memory limit), "
    "drop unused sets, or use --backing tmpfs with a shm folder sized for the tables"
)


@dataclass(frozen=True)
class _Held:
    manifest: Manifest
    tables: int
    manifest_fd: int


class MemfdBacking(Backing):
    """Sealed memfds held by the daemon (and systemd's fd store, where there is one)."""

    name: ClassVar[str] = "memfd"
    handle_kinds = frozenset({HandleKind.FD})

    def __init__(self, fd_store: FdStore, huge_page_size: int = 0, node: int | None = None) -> None:
        self._fd_store = fd_store
        self._held: dict[str, _Held] = {}
        # pin, checksum and remove run on different threads: a descriptor is
        # used under this lock or through a dup, never after remove closed it.
        self._lock = threading.Lock()
        #: hugetlb pages of this size (MFD_HUGETLB), or 0 for the kernel's own pages.
        self.huge_page_size = huge_page_size
        self.page_size = huge_page_size or page_size_of_memfd()
        if self.page_size <= 4096:
            self.small_pages_reason = (
                f"memfd sets get 4 KiB pages: shmem_enabled is {shmem_enabled()}"
            )
            self.small_pages_fix = (
                "for 2 MiB pages set /sys/kernel/mm/transparent_hugepage/shmem_enabled to "
                "within_size, or use --page-size 2M (a hugetlb pool)"
            )
        #: hugetlb pages come from this NUMA node's pool (--numa node:N), else from any.
        self.node = node

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> MemfdBacking:
        """memfds need no folder and no group: workers get descriptors."""
        if config.page_size and config.page_size not in MEMFD_PAGE_SIZES:
            sizes = ", ".join(gib(n) for n in MEMFD_PAGE_SIZES)
            raise ValueError(f"--page-size {gib(config.page_size)}: memfds take {sizes} pages")
        return cls(fd_store, config.page_size, config.numa.node)

    def footprint(self, sizes: list[int]) -> int:
        """hugetlb: one packed memfd in whole huge pages; else each tensor in pages of its own."""
        if not self.huge_page_size:
            return super().footprint(sizes)
        return self.reserved(packed_offsets(sizes)[1])

    @property
    def survives_restart(self) -> bool:
        """Only where systemd's fd store keeps the descriptors."""
        return self._fd_store.available

    def claim(self) -> None:
        """Say whether sets will outlive this daemon."""
        if not self.survives_restart:
            log.info(
                "memfd sets live as long as this daemon (no systemd fd store: "
                "FileDescriptorStoreMax= unset, or not run by systemd); after a restart they "
                "are loaded again, and running workers keep the copy they map"
            )

    def usage(self) -> Usage:
        """The daemon's memory bound, or the hugetlb pool; used: the sets held."""
        with self._lock:
            used = sum(self.footprint(extents(h.manifest.tensors)) for h in self._held.values())
        if self.huge_page_size:
            p = pool(self.huge_page_size, self.node)
            return Usage(str(p.sysfs), p.total, used, p.free, self.page_size)
        limit = memory_limit()
        return Usage(limit.where, limit.total, used, limit.available, self.page_size)

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Refuse a set larger than the daemon's memory bound (or huge page pool), or its room."""
        if self.huge_page_size:
            p = pool(self.huge_page_size, self.memory_node(node))
            if needed > p.free + reclaimable:
                raise ShmCapacityError(
                    f"{what} needs {gib(needed)} of {gib(p.page_size)} huge pages but "
                    f"{gib(p.free)} of {gib(p.total)} are free; {p.fix(needed + p.total - p.free)}"
                )
            return
        check_memory(needed, what, reclaimable, FIX_MEMORY)

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        """An unsealed memfd with every tensor's pages allocated."""
        return _StagedMemfd(self, plan, node)

    def adopt(self) -> list[Manifest]:
        """The sets systemd passed back from its fd store; anything else is closed."""
        passed = self._fd_store.take()
        found = []
        for name in sorted(passed):
            copy, _, part = name.rpartition(".")
            if part != TABLES:
                continue
            manifest_fd = passed.pop(f"{copy}.{MANIFEST}", None)
            tables = passed.pop(name)
            try:
                if manifest_fd is None:
                    raise ManifestError("its manifest was not passed")
                manifest = _check_adopted(copy, tables, manifest_fd)
            except (OSError, ManifestError) as e:
                log.warning("not adopting set %s from the fd store: %s", copy, e)
                self._forget(copy, tables, manifest_fd)
                continue
            with self._lock:
                self._held[copy] = _Held(manifest, tables, manifest_fd)
            found.append(manifest)
        for name, fd in passed.items():
            log.warning("closing descriptor %r from the fd store: not a memfd set", name)
            os.close(fd)
            self._fd_store.remove(name)
        return found

    def _forget(self, copy: str, *fds: int | None) -> None:
        for fd in fds:
            if fd is not None:
                # A descriptor systemd passed may be anything, even one closed already.
                with contextlib.suppress(OSError):
                    os.close(fd)
        for part in (TABLES, MANIFEST):
            self._fd_store.remove(f"{copy}.{part}")

    def _dup(self, copy: str) -> int:
        with self._lock:
            held = self._held.get(copy)
            if held is None:
                raise ManifestError(f"set {copy} is no longer held")
            return os.dup(held.tables)

    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        """Map the tensor's range of the set's memfd read-only and lock it."""
        t = manifest.tensors[index]
        try:
            fd = self._dup(manifest.copy)
        except ManifestError:
            return  # dropped meanwhile
        try:
            pins.pin_fd(fd, t.offset, t.nbytes, f"memfd of set {manifest.copy}")
        finally:
            os.close(fd)

    def checksum(self, manifest: Manifest, index: int, like: str = "") -> str:
        """The digest, of the kind `like` names (the manifest's checksum's by default), of the
        tensor's range as it is now."""
        t = manifest.tensors[index]
        fd = self._dup(manifest.copy)
        try:
            return digest_fd_as(fd, t.offset, t.nbytes, like or t.checksum)
        finally:
            os.close(fd)

    def remove(self, copy: str) -> None:
        """Close the copy's memfds and take them out of the fd store."""
        with self._lock:
            held = self._held.pop(copy, None)
        if held is not None:
            self._forget(copy, held.tables, held.manifest_fd)

    def handles(self, manifest: Manifest, kind: HandleKind) -> list[Handle]:
        """HandleKind.FD handles into the set's one memfd."""
        return self.fd_handles(manifest)

    def mapped_as(self, copy: str) -> str:
        """The memfd's name as the kernel shows it."""
        return f"/memfd:engramd-{copy} "

    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        """A read-only descriptor of the set's memfd (a new open of it, O_RDONLY)."""
        with self._lock:
            held = self._held.get(manifest.copy)
            if held is None:
                raise ManifestError(f"set {manifest.copy} is no longer held")
            return [(TABLES, os.open(f"/proc/self/fd/{held.tables}", os.O_RDONLY | os.O_CLOEXEC))]


class _StagedMemfd(StagedSet):
    def __init__(self, backing: MemfdBacking, plan: TablePlan, node: int | None) -> None:
        self._backing = backing
        self._plan = plan
        sizes = extents(plan.tensors)
        huge = backing.huge_page_size
        if huge:
            self._offsets, _ = packed_tensors(plan.tensors)
        else:
            # Each tensor in pages of its own: a running sum of the pages before it, its lead.
            places = itertools.accumulate(map(backing.reserved, sizes), initial=0)
            self._offsets = [at + lead(t) for at, t in zip(places, plan.tensors, strict=False)]
        size = backing.footprint(sizes)
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if huge:
            flags |= os.MFD_HUGETLB | MEMFD_PAGE_SIZES[huge]
        self._fd = os.memfd_create(f"engramd-{copy_name(plan.set_id, node)}", flags)
        self._writer: MappedWriter | None = None
        try:
            os.ftruncate(self._fd, size)
            if size:
                # Every page now, on several threads: a set that does not fit fails
                # here, not as a SIGBUS in the middle of the copy.
                reserve_files([(self._fd, size)], huge or mmap.PAGESIZE, hugetlb=bool(huge))
                if huge:
                    self._writer = MappedWriter(self._fd, size)  # hugetlb has no write()
        except OSError as e:
            os.close(self._fd)
            fix = pool(huge, backing.memory_node(node)).fix(size) if huge else FIX_MEMORY
            raise ShmCapacityError(
                f"could not allocate {gib(size)} of memory for set {plan.set_id} "
                f"({e.strerror}); {fix}"
            ) from None

    def placement(self, index: int) -> tuple[str, int]:
        """Every tensor in the set's one memfd, at its lead past a page boundary."""
        return TABLES, self._offsets[index]

    def memory(self, index: int) -> tuple[int, int]:
        """The set's one memfd, at the tensor's offset."""
        return self._fd, self._offsets[index]

    def write(self, index: int, data: memoryview, offset: int) -> None:
        """Positional writes into the memfd (through a mapping on hugetlb pages)."""
        at = self._offsets[index] + offset
        if self._writer is not None:
            self._writer.write(data, at)
            return
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], at + done)

    def publish(self, manifest: Manifest) -> None:
        """Seal the tables and a memfd of the manifest; hold both (and store them)."""
        self._unmap()  # a writable mapping would keep F_SEAL_WRITE out (EBUSY)
        manifest_fd = os.memfd_create(
            f"engramd-{manifest.copy}-manifest", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        try:
            os.write(manifest_fd, manifest.to_json().encode())
            for fd in (self._fd, manifest_fd):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(manifest_fd)
            raise
        backing = self._backing
        with backing._lock:
            backing._held[manifest.copy] = _Held(manifest, self._fd, manifest_fd)
        store = backing._fd_store
        for part, fd in ((TABLES, self._fd), (MANIFEST, manifest_fd)):
            store.store(f"{manifest.copy}.{part}", fd)

    def discard(self) -> None:
        """Close the memfd: its pages go with it."""
        self._unmap()
        os.close(self._fd)

    def _unmap(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _check_adopted(copy: str, tables: int, manifest_fd: int) -> Manifest:
    """The manifest of a set passed back by the fd store, once both memfds prove complete."""
    for fd in (tables, manifest_fd):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ManifestError("a descriptor is not a memfd of engramd's own")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise ManifestError("a memfd is not sealed (the load never finished)")
    manifest = Manifest.from_json(os.pread(manifest_fd, os.fstat(manifest_fd).st_size, 0))
    if manifest.copy != copy:
        raise ManifestError(f"the manifest names set {manifest.copy}")
    end = max((t.offset + t.nbytes for t in manifest.tensors), default=0)
    if os.fstat(tables).st_size < end:
        raise ManifestError(f"the tables memfd is shorter than its manifest's {end} bytes")
    return manifest
