"""The sets the daemon holds, by key: one place that adds, finds and removes them."""

from __future__ import annotations

from engramd.backings import Backing
from engramd.sets.tableset import SetKey, SetState, TableSet, set_key
from engramd.values import Placement


class SetRegistry:
    """Every copy of every set, known by (set id, backing, node); the event loop's alone."""

    def __init__(self, backings: list[Backing], placement: Placement) -> None:
        self._backings = backings
        self._placement = placement
        self._sets: dict[SetKey, TableSet] = {}

    def add(self, ts: TableSet) -> None:
        """Hold `ts` (in place of any copy with its key)."""
        self._sets[ts.key] = ts

    def remove(self, ts: TableSet) -> None:
        """Forget `ts`."""
        del self._sets[ts.key]

    def all(self) -> list[TableSet]:
        """Every copy, in the order they came."""
        return list(self._sets.values())

    def by_key(self, key: SetKey) -> TableSet | None:
        """The copy with this key, if held."""
        return self._sets.get(key)

    def holds(self, ts: TableSet) -> bool:
        """True while `ts` itself is held (not dropped, not replaced by a reload)."""
        return self._sets.get(ts.key) is ts

    def copies(self, set_id: str) -> list[TableSet]:
        """Every copy of the set with this id, in any state: by backing order, then node."""
        return [
            ts
            for b in self._backings
            for node in self._placement.copy_nodes
            if (ts := self._sets.get(set_key(set_id, b.name, node)))
        ]

    def get(self, set_id: str, node: int | None = None) -> TableSet | None:
        """The set with this id (its copy for `node`, if given): first not failed, by backing."""
        held = [ts for ts in self.copies(set_id) if node is None or ts.node == node]
        return next((ts for ts in held if ts.state is not SetState.FAILED), None) or next(
            iter(held), None
        )

    def published(self, set_id: str) -> bool:
        """True when the operator loaded the set with this id (any copy of it)."""
        return any(ts.published for ts in self.copies(set_id))

    def copy_node_for(self, worker_node: int | None) -> int | None:
        """The node of the copy a worker on `worker_node` maps (None: the one copy)."""
        return self._placement.copy_node_for(worker_node)
