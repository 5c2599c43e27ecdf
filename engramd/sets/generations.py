"""A set's generations: a new revision of its tables replaces the set served before.

`engramd load` of a checkpoint whose files changed (another set id; the same
tensors, dtypes and shapes), or of another folder named to replace a set
(LoadIntent.replaces), publishes the new set as the old one's next generation.
The old copy stays while leases hold it: each lease's worker is told (the
Attach stream's Stale, with the next set id) and moves all its tables at one
step boundary (the client's Tables.advance()), then ends the old lease; once
the last one has, the store drops the old copy (SetStore.retire_replaced).

A revision of other tensors or shapes is refused before a byte is loaded:
engines sized their buffers and captured CUDA graphs for the tables' shapes,
so only a restart can take it.
"""

from __future__ import annotations

import logging

from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import SetState, TableSet
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import InvalidRequest, UnknownSet

log = logging.getLogger("engramd")


def replaced_by_load(sets: SetRegistry, plan: TablePlan, replaces: str) -> list[TableSet]:
    """The copies the operator's load of `plan` replaces: those of set `replaces`, or
    (without it) the current sets the operator loaded (or a restart adopted) from the same
    checkpoint and selection under another id (its files changed). Refuses other shapes
    (check_shapes).

    A restarted daemon does not remember which set replaced which; the operator's load
    of the new revision again tells the leases still on the old one."""
    if replaces:
        if replaces == plan.set_id:
            raise InvalidRequest(
                f"{plan.where} is set {replaces} itself: a set cannot replace itself; "
                "load the new revision's folder"
            )
        old = sets.copies(replaces)
        if not old:
            raise UnknownSet(
                f"engramd holds no set {replaces} to replace (`engramd status` lists the sets)"
            )
    else:
        old = [
            ts
            for ts in sets.all()
            if (ts.published or ts.adopted)
            and ts.checkpoint == plan.where
            and ts.selection == plan.selection
            and ts.set_id != plan.set_id
        ]
    old = [ts for ts in old if ts.state is SetState.READY and not ts.replaced_by]
    for ts in old:
        check_shapes(ts, plan)
    return old


def check_shapes(old: TableSet, plan: TablePlan) -> None:
    """Refuse `plan` as the next generation of `old` unless its tensors are old's, each
    with the same dtype and shape."""
    assert old.manifest is not None
    theirs = {t.name: (t.dtype, tuple(t.shape)) for t in old.manifest.tensors}
    ours = {t.name: (t.dtype, tuple(t.shape)) for t in plan.tensors}
    differs = [
        f"{name}: {theirs.get(name, 'none')} -> {ours.get(name, 'none')}"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]
    if differs:
        raise InvalidRequest(
            f"{plan.where} cannot replace set {old.set_id} under running engines: its tables "
            f"differ ({'; '.join(differs[:4])}{'; ...' if len(differs) > 4 else ''}), and "
            "engines sized their buffers and captured CUDA graphs for the old tables' shapes, "
            "so a restart is needed: stop the engines on set "
            f"{old.set_id}, `engramd drop {old.set_id}`, `engramd load` this checkpoint, "
            "then start the engines"
        )


def succeed(old: list[TableSet], new: list[TableSet]) -> int:
    """Make `new` (one set's copies) the next generation of the copies `old` and tell the
    workers of old's leases to move; returns how many were told."""
    generation = max(ts.generation for ts in old) + 1
    set_id = new[0].set_id
    for ts in new:
        ts.generation = generation
    told = 0
    for ts in old:
        ts.replaced_by = set_id
        for lease in ts.leases.values():
            lease.told_stale.set()
        told += len(ts.leases)
        log.info(
            "set %s is replaced by set %s (generation %d): %d leases told to move; it is "
            "dropped once the last has",
            ts.copy,
            set_id,
            generation,
            len(ts.leases),
        )
    return told
