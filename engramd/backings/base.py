"""What every backing of table sets provides: one interface, one module per backing.

A backing is where the bytes of a set live (files in a tmpfs folder, sealed
memfds). The loader's read-and-digest loop is the same for all of them and
writes through `StagedSet.write`; the store adopts, pins, verifies and
removes through the backing; the service hands out the backing's handles and
the fd channel its read-only descriptors.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from engramd.backings.handles import FileRange, Handle, HandleKind
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.pagesize import PageCensus, census
from engramd.host.pagewarm import Warmed
from engramd.host.pinning import PinnedFiles
from engramd_shared.checkpoint import TablePlan
from engramd_shared.layout import Manifest


@dataclass(frozen=True)
class Usage:
    """What a backing holds, in bytes, and the page size that backs new sets."""

    where: str
    total: int
    used: int
    free: int
    page_size: int


class BackingUnavailable(Exception):
    """The backing asked for cannot work here (no CUDA driver, a device without cuMem, ...)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        #: The backing's name.
        self.name = name
        #: Why, in one line.
        self.reason = reason


class StagedSet(ABC):
    """A set being loaded: every byte reserved, nothing visible to workers yet."""

    @abstractmethod
    def placement(self, index: int) -> tuple[str, int]:
        """(file, offset) of the index-th tensor, as the manifest records it."""

    @abstractmethod
    def write(self, index: int, data: memoryview, offset: int) -> None:
        """Write `data` at `offset` within the index-th tensor."""

    def memory(self, index: int) -> tuple[int, int]:
        """(descriptor, offset) of the index-th tensor's reserved bytes, for a source that
        writes them through a mapping of its own (NIXL); the descriptor stays the set's.

        Backings whose memory is no file (cuMem) raise NotImplementedError: their sets
        are loaded from the checkpoint's files.
        """
        raise NotImplementedError(f"{type(self).__name__} has no memory to map")

    @abstractmethod
    def publish(self, manifest: Manifest) -> None:
        """Make the set visible, complete: nothing writes to it again."""

    @abstractmethod
    def discard(self) -> None:
        """Remove everything staged (the load failed or was cancelled)."""


class Backing(ABC):
    """Where sets live; chosen by name (`BACKINGS` in engramd.backings)."""

    #: The backing's name in status, metrics and flags.
    name: ClassVar[str]
    #: Handle kinds this backing can hand out.
    handle_kinds: frozenset[HandleKind]
    #: `descriptors` can open the set's files writable (--allow-writable-gpu-mappings).
    writable_descriptors: ClassVar[bool] = False
    #: Its sets' pages are locked in memory with --mlock (a disk's are the page cache's).
    lockable: ClassVar[bool] = True
    #: Its sets are served from the page cache, which `warm` reads them into (a disk's).
    warmable: ClassVar[bool] = False
    #: Bytes per page backing new sets (fixed for the backing's life).
    page_size: int
    #: The backing asked for that this one replaces (it cannot work here), or "".
    stands_in_for: str = ""
    #: Why the backing asked for cannot work here, or "".
    reason: str = ""
    #: Why new sets get 4 KiB pages here where huge pages could back them (one short line),
    #: or "".
    small_pages_reason: str = ""
    #: With small_pages_reason: the fix, in full.
    small_pages_fix: str = ""
    #: The NUMA node pages come from where the backing picks them by node (a hugetlb
    #: pool, cuMem host memory): --numa node:N's, or its own choice; else None.
    node: int | None = None

    def memory_node(self, copy_node: int | None) -> int | None:
        """The NUMA node of a copy's pages: a per-node copy's node, else the backing's."""
        return self.node if copy_node is None else copy_node

    @classmethod
    @abstractmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> Backing:
        """The backing a daemon with `config` uses; `gid` may attach (owns its files)."""

    @property
    @abstractmethod
    def survives_restart(self) -> bool:
        """Sets outlive the daemon, for the next one to adopt."""

    @abstractmethod
    def claim(self) -> None:
        """Take possession at start (make or check the daemon's own place)."""

    def release(self) -> None:
        """Give up what claim() holds for the daemon's life (at shutdown); most hold nothing."""
        return None

    @abstractmethod
    def usage(self) -> Usage:
        """What the backing holds and can hold."""

    def reserved(self, nbytes: int) -> int:
        """Bytes of `nbytes` rounded up to whole pages."""
        return -(-nbytes // self.page_size) * self.page_size

    def footprint(self, sizes: list[int]) -> int:
        """Bytes a set of tensors of these sizes takes (each in whole pages of its own)."""
        return sum(self.reserved(n) for n in sizes)

    @abstractmethod
    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        """Raise ShmCapacityError, naming the sizes and the fix, unless `needed` bytes fit.

        `reclaimable` bytes count as free: sets the caller will evict first.
        `node`: the NUMA node of a copy kept per node (its pages come from there).
        """

    @abstractmethod
    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        """Reserve every byte of the plan's tensors (a copy for `node`); a full backing fails here.

        The caller has bound its thread's memory policy to the copy's node.
        """

    @abstractmethod
    def adopt(self) -> list[Manifest]:
        """The complete sets of the daemon's own found at start; everything else is removed."""

    @abstractmethod
    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        """Lock the index-th tensor of a set in memory (recorded in `pins`)."""

    @abstractmethod
    def checksum(self, manifest: Manifest, index: int, like: str = "") -> str:
        """The digest of the index-th tensor as it is now, of the kind `like` names (a
        checksum's or a strong digest's, engramd.strong.digester; "": its manifest's checksum's)."""

    @abstractmethod
    def remove(self, copy: str) -> None:
        """Unlink a copy of a set (layout.copy_name); its memory returns when the last worker
        unmaps it."""

    @abstractmethod
    def handles(self, manifest: Manifest, kind: HandleKind) -> list[Handle]:
        """One handle of `kind` per tensor of the set."""

    @abstractmethod
    def mapped_as(self, copy: str) -> str | None:
        """What numa_maps shows for mappings of a copy's files; None where it shows nothing."""

    @abstractmethod
    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        """(file, read-only descriptor) for each file of the set; the caller closes them.

        `writable` (only where `writable_descriptors`): opened read-write instead.
        """

    def page_census(self, manifest: Manifest) -> PageCensus | None:
        """The pages the kernel backs the set's files with; None for sets that are not files."""
        if HandleKind.FD not in self.handle_kinds:
            return None
        opened = self.descriptors(manifest)
        try:
            return census([fd for _, fd in opened])
        finally:
            for _, fd in opened:
                os.close(fd)

    def share_with_group(self, manifest: Manifest) -> None:
        """Let the socket group map a published set by path; sets that are no files have none."""
        return None

    def damage(self, manifest: Manifest) -> list[str]:
        """What makes a held set unfit to hand out now, checked at each attach; none here."""
        return []

    def resident(self, manifest: Manifest) -> int | None:
        """Bytes of the set in memory where the kernel may evict them (a disk's page
        cache); None where the set is held in memory whole."""
        return None

    def warm(self, manifest: Manifest, stop: threading.Event) -> Warmed:
        """Read the set into the page cache it is served from, within what the node can spare,
        until `stop` is set (only where `warmable`)."""
        raise NotImplementedError(f"{self.name} sets are held in memory whole")

    @staticmethod
    def fd_handles(manifest: Manifest) -> list[Handle]:
        """HandleKind.FD handles: each tensor's file (as `descriptors` names it) and range."""
        return [
            Handle(t.name, t.dtype, t.shape, FileRange(t.file, t.offset, t.nbytes))
            for t in manifest.tensors
        ]
