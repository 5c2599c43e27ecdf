"""Admission: whether a set may be loaded, where (which backing), and what to evict first.

The memory budget (--memory-budget), eviction of idle sets (--evict-idle) and
each backing's own capacity are judged here, before a byte is copied.
"""

from __future__ import annotations

import time
from collections import Counter

from engramd.backings import Backing
from engramd.sets.leases import LeaseBook
from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import COMPLETE, SetState, TableSet
from engramd.units import gib
from engramd_shared.errors import BudgetExceeded, QuotaExceeded, ShmCapacityError
from engramd_shared.layout import extents


class Admission:
    """Places sets in the first backing that holds them, within the memory budget."""

    def __init__(
        self,
        backings: list[Backing],
        sets: SetRegistry,
        budget: int = 0,
        evict_idle: bool = False,
        share_per_uid: float = 0.0,
    ) -> None:
        self._backings = backings
        self._sets = sets
        self._budget = budget
        self._evict_idle = evict_idle
        self._share = share_per_uid

    def check_share(self, charges: dict[int, int], what: str) -> None:
        """Raise QuotaExceeded when a worker's load of `charges` (bytes by the uid owning
        their files) would take a uid past its share (--worker-share-per-uid).

        Sets the operator published count for no one: only workers' loads are charged.
        """
        if not self._share or not charges:
            return
        whole = self._budget or self._backings[0].usage().total
        limit = int(self._share * whole)
        held: Counter[int] = Counter()
        for ts in self._sets.all():
            if ts.state is not SetState.FAILED and not ts.published and ts.charges:
                held.update(ts.charges)
        for uid, nbytes in sorted(charges.items()):
            if held[uid] + nbytes > limit:
                raise QuotaExceeded(
                    f"{what} needs {gib(nbytes)} more of sets workers' attaches loaded from "
                    f"files of uid {uid}, which hold {gib(held[uid])} of its share of "
                    f"{gib(limit)} ({self._share:g} of {gib(whole)}, --worker-share-per-uid); "
                    "sets no worker holds are dropped after --worker-set-grace, or the "
                    "operator may load the checkpoint for all (engramd load)"
                )

    def needed(self, sizes: list[int]) -> int:
        """The most any backing would take for tensors whose places take these bytes."""
        return max(b.footprint(sizes) for b in self._backings)

    def victims(self, needed: int, what: str) -> list[TableSet]:
        """The idle sets to evict so that `needed` more bytes fit the budget; raises if none do."""
        if not self._budget:
            return []
        held = sum(self.reserved(ts) for ts in self._sets.all() if ts.state is not SetState.FAILED)
        victims: list[TableSet] = []
        if held + needed > self._budget and self._evict_idle:
            now = time.monotonic()
            idle = sorted(
                (
                    ts
                    for ts in self._sets.all()
                    if ts.state in COMPLETE and not LeaseBook.count(ts) and ts.idle_after <= now
                ),
                key=lambda ts: ts.last_used,
            )
            for ts in idle:
                if held + needed <= self._budget:
                    break
                victims.append(ts)
                held -= self.reserved(ts)
        if held + needed > self._budget:
            raise BudgetExceeded(
                f"{what} needs {gib(needed)}, the daemon holds {gib(held)} of its "
                f"{gib(self._budget)} memory budget; drop a set (engramd drop), raise "
                "--memory-budget, or let idle sets be evicted (--evict-idle; sets adopted "
                "at start count as idle only after --adopt-grace)"
            )
        return victims

    def place(
        self, sizes: list[int], what: str, victims: list[TableSet], node: int | None
    ) -> Backing:
        """The first backing that can hold the tensors (counting what evicting `victims` frees)."""
        refusals = []
        for backing in self._backings:
            needed = backing.footprint(sizes)
            freed = sum(self.reserved(v) for v in victims if v.backing is backing)
            try:
                backing.check_capacity(needed, what, reclaimable=freed, node=node)
                return backing
            except ShmCapacityError as e:
                refusals.append(e)
        if len(refusals) == 1:
            raise refusals[0]
        raise ShmCapacityError(
            "; ".join(f"{b.name}: {e}" for b, e in zip(self._backings, refusals, strict=True))
        )

    @staticmethod
    def reserved(ts: TableSet) -> int:
        """What a set holds of its backing: whole pages (of its manifest once loaded)."""
        if ts.manifest is None:
            return ts.backing.reserved(ts.nbytes)
        return ts.backing.footprint(extents(ts.manifest.tensors))
