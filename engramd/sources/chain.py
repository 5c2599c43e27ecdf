"""The order of sources for a load: the peers (all at once, peer.py), then the object store,
then the files.

Called by the loader (sets.loader.Fill) on its thread with the set staged:
every byte reserved, nothing visible. Each source that fails says why in
one log line and the next runs on the same staged memory (it writes every
byte again); when none is left, the loader copies from the files. Nothing
is published before a source's bytes passed its checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from engramd.backings import StagedSet
from engramd.sources.base import Progress, SourceFailed
from engramd.sources.nixlxfer import spare
from engramd.sources.objstore import ObjectStoreSource
from engramd.sources.peer import PeerSource
from engramd.sources.regions import close_all, staged_regions
from engramd.sources.trust import Filled, FleetKey
from engramd_shared.checkpoint import TablePlan

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
        spare.keep()

    def __call__(self, plan: TablePlan, staged: StagedSet, progress: Progress) -> Filled | None:
        """Fill `staged` from the first source that can; None: load from the files."""
        try:
            regions = staged_regions(staged, [t.nbytes for t in plan.tensors])
        except NotImplementedError as e:
            log.info("set %s: %s; loading from the files", plan.set_id, e)
            return None
        attempts: list[tuple[str, Callable[[], Filled]]] = []
        if self._peers is not None:
            attempts.append(("peers", partial(self._peers.fill, plan, regions, progress)))
        if self._store is not None:
            attempts.append((self._store.url, partial(self._store.fill, plan, regions, progress)))
        try:
            for k, (source, read) in enumerate(attempts):
                progress.restart(source)
                try:
                    return read()
                except SourceFailed as e:
                    then = (
                        "trying the next source"
                        if k + 1 < len(attempts)
                        else "loading from the files"
                    )
                    log.warning("set %s: %s: %s; %s", plan.set_id, source, e, then)
            progress.restart("files")
            return None
        finally:
            close_all(regions)
