"""The order of sources for a load: the peers (all at once, peer.py), then the object store,
then the files.

A checkpoint planned from an object store (`--checkpoint s3://...`) has no
files on the node: its store is a source of the fill whatever
`--object-store` says, and when no source can give the set the load fails
and says why.

Called by the loader (sets.loader.Fill) on its thread with the set staged:
every byte reserved, nothing visible. Each source that fails says why in
one log line and the next runs on the same staged memory (it writes every
byte again); when none is left, the loader copies from the files. Nothing
is published before a source's bytes passed its checks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial

from engramd.backings import StagedSet
from engramd.backings.regions import close_all, staged_regions
from engramd.fleet.base import SourceFailed
from engramd.fleet.nixlxfer import spare
from engramd.fleet.objstore import ObjectStoreSource, StoreUnanswered
from engramd.fleet.peer import PeerSource
from engramd.fleet.trust import FleetKey
from engramd.sets.seams import Filled, FillProgress, StoreUnreadable
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import CheckpointError

log = logging.getLogger("engramd")


class SourceChain:
    """Peers, then an object store, each optional; a loader's `fill`."""

    def __init__(
        self,
        peers: PeerSource | None,
        store: ObjectStoreSource | None,
        key: FleetKey | None = None,
    ) -> None:
        self._peers = peers
        self._store = store
        #: The fleet's key (--peer-token-file), which `engramd verify` checks attestations with.
        self.key = key
        #: The stores of checkpoints planned from one, by URL.
        self._stores: dict[str, ObjectStoreSource] = {}
        self._lock = threading.Lock()
        if peers is not None or store is not None:
            spare.keep()

    def store_for(self, plan: TablePlan) -> ObjectStoreSource | None:
        """The object store a fill of `plan` reads: its own for a plan made from one, else
        --object-store's."""
        if not plan.store or (self._store is not None and self._store.url == plan.store):
            return self._store
        with self._lock:
            if plan.store not in self._stores:
                self._stores[plan.store] = ObjectStoreSource(plan.store, self.key)
            return self._stores[plan.store]

    def vouch(self, plan: TablePlan) -> None:
        """Return once an attestation valid under the fleet's key covers the set of `plan`, a
        plan made from a store (its id, each tensor's name, dtype, shape and size): the
        store's attested manifest, or a peer's offer. Until then the node reserves nothing
        for a set whose sizes whoever writes the bucket chose. CheckpointError otherwise;
        StoreUnreadable when the store did not answer and no peer vouched."""
        store = self.store_for(plan)
        why: list[str] = []
        unanswered = False
        if store is not None:
            try:
                store.vouch(plan)
                return
            except SourceFailed as e:
                why.append(f"{store.url}: {e}")
                unanswered = isinstance(e, StoreUnanswered)
        if self._peers is not None:
            try:
                self._peers.vouch(plan)
                return
            except SourceFailed as e:
                why.append(f"peers: {e}")
        problem = (
            f"no attestation of the fleet's key covers the set of {plan.store} ({'; '.join(why)})"
        )
        if unanswered:
            raise StoreUnreadable(f"{problem}; the store did not answer")
        raise CheckpointError(
            f"{problem}; nothing was reserved for it: upload its attested manifest beside the "
            "objects (engramd manifest), or start a peer that holds the set (--peers)"
        )

    def __call__(self, plan: TablePlan, staged: StagedSet, progress: FillProgress) -> Filled | None:
        """Fill `staged` from the first source that can; None: load from the files."""
        store = self.store_for(plan)
        if self._peers is None and store is None:
            _to_files(plan, "no peers and no object store are configured", logging.DEBUG, "")
            return None
        try:
            regions = staged_regions(staged, [t.nbytes for t in plan.tensors])
        except NotImplementedError as e:
            _to_files(plan, str(e), logging.INFO, "use a backing sources can fill (--backing)")
            return None
        attempts: list[tuple[str, Callable[[], Filled]]] = []
        if self._peers is not None:
            attempts.append(("peers", partial(self._peers.fill, plan, regions, progress, store)))
        if store is not None:
            attempts.append((store.url, partial(store.fill, plan, regions, progress)))
        failed = []
        try:
            for k, (source, read) in enumerate(attempts):
                progress.restart(source)
                try:
                    return read()
                except SourceFailed as e:
                    failed.append(f"{source}: {e}")
                    if k + 1 < len(attempts):
                        log.warning(
                            "set %s: %s: %s; trying the next source", plan.set_id, source, e
                        )
            _to_files(
                plan,
                "; ".join(failed),
                logging.WARNING,
                "start a peer that holds the set (--peers), or upload its attested manifest "
                "beside the objects (engramd manifest)",
            )
            progress.restart("files")
            return None
        finally:
            close_all(regions)


def _to_files(plan: TablePlan, why: str, level: int, fix: str) -> None:
    """Say that the files fill the set, and why; CheckpointError (with `fix`) when the node
    has none."""
    if plan.store:
        raise CheckpointError(
            f"no source could give the set of {plan.store} ({why}); this node holds no file "
            f"of that checkpoint: {fix or 'give it --peers or an object store'}"
        )
    log.log(level, "set %s: %s; loading from the files", plan.set_id, why)
