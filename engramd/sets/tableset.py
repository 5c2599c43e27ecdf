"""A set's record: its state, where its bytes live, its leases; and how sets are keyed."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engramd.backings import Backing
from engramd.host.pagesize import PageCensus
from engramd.host.pinning import PinnedFiles
from engramd.sets.loader import LoadProgress
from engramd_shared.layout import Manifest, copy_name

if TYPE_CHECKING:
    from engramd.sets.leases import Lease


class SetState(enum.StrEnum):
    """Where a set is in its life; status and metrics show the value."""

    #: Being copied in; never handed out.
    LOADING = "loading"
    #: Complete and published: served to workers.
    READY = "ready"
    #: The load failed; the error is kept for status until the next load.
    FAILED = "failed"
    #: Complete, but a verify found bytes that no longer match their checksums: new
    #: attaches are refused and the leases' workers told their copy is stale, until the
    #: operator loads the set again (engramd load) or drops it.
    FAILED_VERIFICATION = "failed-verification"


#: States of a copy whose files are complete in its backing: what shutdown unlocks and
#: unlinks, and what the fd channel still hands to leases already granted.
COMPLETE = frozenset({SetState.READY, SetState.FAILED_VERIFICATION})


#: A set is known by its id, its backing's name and the NUMA node of a per-node copy:
#: the id never depends on where the bytes are.
SetKey = tuple[str, str, int | None]


def set_key(set_id: str, backing: str, node: int | None = None) -> SetKey:
    """The key of the copy of set `set_id` in the backing named `backing` (for `node`)."""
    return set_id, backing, node


@dataclass
class TableSet:
    """One set: its state, its files once ready, its leases."""

    set_id: str
    checkpoint: str
    #: The fnmatch selection of tensors the set holds.
    selection: str
    fingerprint: str
    nbytes: int
    ntensors: int
    backing: Backing
    #: The NUMA node this copy is kept for (--numa per-node); None: the set's one copy.
    node: int | None = None
    state: SetState = SetState.LOADING
    adopted: bool = False
    #: The operator loaded it (--checkpoint, engramd load): any caller may see and
    #: attach it by its id. Sets that workers' attaches loaded are attached with
    #: their checkpoint only, and proven for it.
    published: bool = False
    manifest: Manifest | None = None
    #: Each tensor's strong digest of the copy's own bytes, by name, once a proof needed
    #: them (SetStore.strong_digests): taken once, from its pages, by the daemon.
    strong: dict[str, str] | None = None
    progress: LoadProgress | None = None
    #: Why the load failed (state failed), or what a verify found (failed-verification).
    error: BaseException | None = None
    #: The tensors whose bytes a verify found changed (state failed-verification).
    changed: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    pins: PinnedFiles = field(default_factory=PinnedFiles)
    #: Every page of the set is locked in memory.
    locked: bool = False
    #: Bytes of the set on each NUMA node, as the daemon's pinned mappings show (numa_maps).
    nodes: dict[int, int] = field(default_factory=dict)
    #: Its page cache warm-up (engramd.sets.warming): "waiting", "warming", "warmed", "off",
    #: "stopped: <why>"; "" for a set held in memory whole.
    warming: str = ""
    #: The pages backing the set, as the kernel maps them (measured once ready), or None.
    pages: PageCensus | None = None
    leases: dict[str, Lease] = field(default_factory=dict)
    #: When a worker last attached or detached (or the set became ready).
    last_used: float = field(default_factory=time.monotonic)
    #: Not evicted as idle before this time (adopted sets: their workers re-attach).
    idle_after: float = 0.0
    #: A set a worker's attach loaded: its bytes by the uid that owns the checkpoint files
    #: they came from (--worker-share-per-uid; root's and the daemon's own files are the
    #: operator's, charged to no one). None: the operator's set, or one adopted at start.
    charges: dict[int, int] | None = None
    #: Its generation (engramd.sets.generations): 1 for a set's first load, one more for
    #: each load that replaced the one before.
    generation: int = 1
    #: The set id of the generation that replaced this one ("" while it is current): its
    #: leases are told to move there, and it is dropped once the last one has.
    replaced_by: str = ""
    #: Set once the load ends, ready or failed.
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def copy(self) -> str:
        """This copy's name in its backing: the set id, with the node of a per-node copy."""
        return copy_name(self.set_id, self.node)

    @property
    def key(self) -> SetKey:
        """How the store knows this copy."""
        return set_key(self.set_id, self.backing.name, self.node)

    @property
    def bytes_loaded(self) -> int:
        """Bytes copied so far (all of them once complete)."""
        if self.state in COMPLETE:
            return self.nbytes
        return self.progress.done if self.progress else 0

    @property
    def bytes_by_source(self) -> dict[str, int]:
        """The bytes each of several sources gave the load (a fill from peers)."""
        return dict(self.progress.by_source) if self.progress is not None else {}

    @property
    def source(self) -> str:
        """Where the set's bytes came from: the load's source, or "adopted"."""
        if self.progress is not None:
            return self.progress.source
        return "adopted" if self.adopted else ""
