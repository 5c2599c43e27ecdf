"""Admission (engramd.sets.admission): the memory budget, which idle sets go first, which
backing a set goes to, and each uid's share of what workers loaded."""

from __future__ import annotations

import time
from typing import ClassVar, NoReturn

import pytest
from backing_fill import sample_manifest

from engramd.backings import Backing, StagedSet, Usage
from engramd.backings.handles import Handle, HandleKind
from engramd.config import DaemonConfig
from engramd.host.fdstore import FdStore
from engramd.host.pinning import PinnedFiles
from engramd.sets.admission import Admission
from engramd.sets.leases import Lease
from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import SetState, TableSet
from engramd.values import Placement
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import BudgetExceeded, QuotaExceeded, ShmCapacityError
from engramd_shared.layout import Manifest, ManifestTensor

PAGE = 4096
HUGE = 2 << 20


class Pool(Backing):
    """A backing of `total` bytes in pages of `page_size`: only what Admission asks of one.

    Admission judges sizes and capacity; it never stages, maps or removes a set.
    """

    name: ClassVar[str] = "pool"
    handle_kinds = frozenset({HandleKind.FD})

    def __init__(self, label: str, page_size: int, total: int, used: int = 0) -> None:
        self.label = label
        self.page_size = page_size
        self.total = total
        self.used = used

    def usage(self) -> Usage:
        return Usage(self.label, self.total, self.used, self.total - self.used, self.page_size)

    def check_capacity(
        self, needed: int, what: str, reclaimable: int = 0, node: int | None = None
    ) -> None:
        free = self.total - self.used + reclaimable
        if needed > free:
            raise ShmCapacityError(f"{what} needs {needed} bytes, {self.label} has {free} free")

    @classmethod
    def from_config(cls, config: DaemonConfig, gid: int | None, fd_store: FdStore) -> Backing:
        raise NotImplementedError

    @property
    def survives_restart(self) -> bool:
        return False

    def claim(self) -> None:
        self._unused()

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        self._unused()

    def adopt(self) -> list[Manifest]:
        self._unused()

    def pin(self, manifest: Manifest, index: int, pins: PinnedFiles) -> None:
        self._unused()

    def checksum(self, manifest: Manifest, index: int, like: str = "") -> str:
        self._unused()

    def remove(self, copy: str) -> None:
        self._unused()

    def handles(self, manifest: Manifest, kind: HandleKind) -> list[Handle]:
        self._unused()

    def mapped_as(self, copy: str) -> str | None:
        self._unused()

    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        self._unused()

    @staticmethod
    def _unused() -> NoReturn:
        raise AssertionError("Admission only sizes sets and checks capacity")


def held(
    backing: Backing,
    set_id: str,
    nbytes: int,
    *,
    state: SetState = SetState.READY,
    last_used: float = 0.0,
    idle_after: float = 0.0,
    leases: int = 0,
    published: bool = True,
    charges: dict[int, int] | None = None,
) -> TableSet:
    """A set of `nbytes` in `backing`, in `state`, last used at `last_used` (monotonic)."""
    ts = TableSet(
        set_id=set_id,
        checkpoint=f"/models/{set_id}",
        selection="*",
        fingerprint="f" * 64,
        nbytes=nbytes,
        ntensors=1,
        backing=backing,
        state=state,
        published=published,
        last_used=last_used,
        idle_after=idle_after,
        charges=charges,
    )
    for i in range(leases):
        lease = Lease(f"{set_id}-{i}", set_id, backing.name, None, 100 + i, {}, None)
        ts.leases[lease.lease_id] = lease
    return ts


def registry(backings: list[Backing], *sets: TableSet) -> SetRegistry:
    reg = SetRegistry(backings, Placement())
    for ts in sets:
        reg.add(ts)
    return reg


def test_a_set_is_reserved_in_whole_pages_of_its_backing() -> None:
    small, huge = Pool("small", PAGE, 1 << 30), Pool("huge", HUGE, 1 << 30)
    assert Admission.reserved(held(small, "a", 1)) == PAGE
    assert Admission.reserved(held(huge, "a", HUGE + 1)) == 2 * HUGE
    # Once loaded, each tensor takes whole pages of its own (the manifest's sizes count).
    tensors = tuple(
        ManifestTensor(f"t{i}", "BF16", (n // 2,), f"{i:04}.bin", 0, n, "xxh3-64:0")
        for i, n in enumerate((10, PAGE + 1, 0))
    )
    loaded = held(small, "b", 10 + PAGE + 1)
    loaded.manifest = sample_manifest(tensors=tensors)
    assert Admission.reserved(loaded) == 3 * PAGE
    # What a set needs is the most any backing would take for it.
    admission = Admission([small, huge], registry([small, huge]))
    assert admission.needed([10, PAGE + 1]) == 2 * HUGE
    assert Admission([small], registry([small])).needed([10, PAGE + 1]) == 3 * PAGE


def test_without_a_budget_nothing_is_evicted() -> None:
    pool = Pool("shm", PAGE, 1 << 20)
    idle = held(pool, "idle", 1 << 40)
    admission = Admission([pool], registry([pool], idle), budget=0, evict_idle=True)
    assert admission.victims(1 << 40, "set x") == []


def test_the_budget_counts_loading_and_ready_sets_but_not_failed_ones() -> None:
    pool = Pool("shm", PAGE, 1 << 30)
    sets = (
        held(pool, "ready", 40 * PAGE),
        held(pool, "loading", 30 * PAGE, state=SetState.LOADING),
        held(pool, "failed", 500 * PAGE, state=SetState.FAILED),
    )
    admission = Admission([pool], registry([pool], *sets), budget=100 * PAGE)
    # 70 pages held: 30 more fit exactly, one page more does not.
    assert admission.victims(30 * PAGE, "set x") == []
    with pytest.raises(BudgetExceeded, match=r"set x needs .* --memory-budget") as info:
        admission.victims(31 * PAGE, "set x")
    assert "--evict-idle" in str(info.value) and "engramd drop" in str(info.value)


def test_idle_sets_are_evicted_least_recently_used_first_and_only_as_many_as_needed() -> None:
    pool = Pool("shm", PAGE, 1 << 30)
    now = time.monotonic()
    oldest = held(pool, "oldest", 20 * PAGE, last_used=now - 30)
    older = held(pool, "older", 20 * PAGE, last_used=now - 20)
    recent = held(pool, "recent", 20 * PAGE, last_used=now - 10)
    leased = held(pool, "leased", 20 * PAGE, last_used=now - 100, leases=1)
    adopted = held(pool, "adopted", 10 * PAGE, last_used=now - 100, idle_after=now + 600)
    loading = held(pool, "loading", 10 * PAGE, last_used=now - 100, state=SetState.LOADING)
    sets = (recent, leased, oldest, adopted, loading, older)
    admission = Admission([pool], registry([pool], *sets), budget=100 * PAGE, evict_idle=True)
    # 100 pages held, all of the budget: 30 more pages free two idle sets, the oldest first.
    assert admission.victims(30 * PAGE, "set x") == [oldest, older]
    assert admission.victims(1, "set x") == [oldest]
    assert admission.victims(60 * PAGE, "set x") == [oldest, older, recent]
    # A leased set, an adopted one in its grace and a loading one are never evicted.
    with pytest.raises(BudgetExceeded):
        admission.victims(61 * PAGE, "set x")
    # Without --evict-idle nothing is evicted: the same request is refused.
    strict = Admission([pool], registry([pool], *sets), budget=100 * PAGE, evict_idle=False)
    with pytest.raises(BudgetExceeded):
        strict.victims(1, "set x")


def test_a_set_goes_to_the_first_backing_that_holds_it() -> None:
    tmpfs, memfd = Pool("tmpfs", PAGE, 16 * PAGE), Pool("memfd", PAGE, 1 << 30)
    admission = Admission([tmpfs, memfd], registry([tmpfs, memfd]))
    assert admission.place([8 * PAGE], "set x", [], None) is tmpfs
    assert admission.place([16 * PAGE + 1], "set x", [], None) is memfd
    # What evicting its victims frees counts in their own backing only.
    tmpfs.used = 12 * PAGE
    victim = held(tmpfs, "victim", 8 * PAGE)
    elsewhere = held(memfd, "elsewhere", 8 * PAGE)
    assert admission.place([10 * PAGE], "set x", [elsewhere], None) is memfd
    assert admission.place([10 * PAGE], "set x", [victim], None) is tmpfs


def test_a_set_no_backing_holds_is_refused_with_each_backings_reason() -> None:
    tmpfs, memfd = Pool("tmpfs", PAGE, 4 * PAGE), Pool("memfd", PAGE, 8 * PAGE)
    with pytest.raises(ShmCapacityError) as both:
        Admission([tmpfs, memfd], registry([tmpfs, memfd])).place([9 * PAGE], "set x", [], None)
    assert str(both.value).startswith("pool: set x needs")
    assert "tmpfs has 16384 free" in str(both.value) and "memfd has 32768 free" in str(both.value)
    with pytest.raises(ShmCapacityError, match=r"^set x needs 36864 bytes, tmpfs has 16384 free$"):
        Admission([tmpfs], registry([tmpfs])).place([9 * PAGE], "set x", [], None)


def test_each_uid_takes_at_most_its_share_of_what_workers_loaded() -> None:
    pool = Pool("shm", PAGE, 1 << 30)
    mine = held(pool, "mine", 0, published=False, charges={1000: 20 * PAGE})
    theirs = held(pool, "theirs", 0, published=False, charges={1001: 25 * PAGE})
    # The operator's sets and failed loads are charged to no one.
    published = held(pool, "published", 0, published=True, charges={1000: 50 * PAGE})
    failed = held(pool, "failed", 0, published=False, state=SetState.FAILED, charges={1000: PAGE})
    sets = registry([pool], mine, theirs, published, failed)
    admission = Admission([pool], sets, budget=100 * PAGE, share_per_uid=0.25)
    admission.check_share({1000: 5 * PAGE}, "set x")
    with pytest.raises(QuotaExceeded, match=r"set x needs .* uid 1000, .*--worker-share-per-uid"):
        admission.check_share({1000: 5 * PAGE + 1}, "set x")
    # One uid's loads leave another's share alone.
    admission.check_share({1002: 25 * PAGE}, "set x")
    with pytest.raises(QuotaExceeded, match="uid 1001"):
        admission.check_share({1002: PAGE, 1001: PAGE}, "set x")
    # No share set: nothing is charged; no budget: the share is of the first backing's size.
    Admission([pool], sets, budget=100 * PAGE).check_share({1000: 1 << 40}, "set x")
    whole = Admission([pool], sets, share_per_uid=0.25)
    whole.check_share({1000: (1 << 28) - 20 * PAGE}, "set x")
    with pytest.raises(QuotaExceeded):
        whole.check_share({1000: (1 << 28) - 20 * PAGE + 1}, "set x")
