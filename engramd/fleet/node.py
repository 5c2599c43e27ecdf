"""The fleet of one daemon, built from its flags: the seams it offers the core, its listener.

The lifecycle builds a `Fleet` only when a fleet flag is set (`wanted`), and
it reads the fleet's token once, here.
"""

from __future__ import annotations

from engramd.config import DaemonConfig
from engramd.fleet.chain import SourceChain
from engramd.fleet.filling import FillingSets
from engramd.fleet.objectplan import plan_objects
from engramd.fleet.objstore import ObjectStoreSource
from engramd.fleet.peer import PeerSource
from engramd.fleet.peerservice import PeerServer
from engramd.fleet.trust import FleetKey, read_token
from engramd.sets.seams import Remote
from engramd.sets.store import SetStore
from engramd_shared.checkpoint import TablePlan


class StorePlanner:
    """Plans checkpoints in object stores; the sources vouch for what the store's headers say."""

    def __init__(self, chain: SourceChain) -> None:
        self._chain = chain

    def plan(self, url: str, selection: str) -> TablePlan:
        """The plan of the checkpoint under `url` (objectplan.plan_objects)."""
        return plan_objects(url, selection)

    def vouch(self, plan: TablePlan) -> None:
        """As SourceChain.vouch: the store's attested manifest, or a peer's offer."""
        self._chain.vouch(plan)


class Fleet:
    """The peers, the object store and the peer service of one daemon."""

    def __init__(self, config: DaemonConfig) -> None:
        self._config = config
        #: The fleet's key, from the one read of --peer-token-file (which --peers and
        #: --peer-listen need: read_token says so); the object store's attested manifests
        #: are checked with it too. An object store alone has none.
        needs_key = config.peers or config.peer_listen or config.peer_token_file
        self.key = FleetKey(read_token(config.peer_token_file)) if needs_key else None
        # Filled from peers by the loads, served to peers by the peer port as they fill.
        self._filling = FillingSets()
        store = ObjectStoreSource(config.object_store, self.key) if config.object_store else None
        peers = (
            PeerSource(
                config.peers, self.key, config.peer_min_rate, self._filling, config.peer_listen
            )
            if self.key is not None and config.peers
            else None
        )
        self._chain = SourceChain(peers, store, self.key)
        #: The seams the core takes (sets/seams.py).
        self.remote = Remote(self._chain, StorePlanner(self._chain), self.key)

    def listener(self, store: SetStore) -> PeerServer | None:
        """The peer service over `store`'s published sets, where --peer-listen asks for one."""
        config = self._config
        if not config.peer_listen or self.key is None:
            return None
        return PeerServer(
            store,
            self._filling,
            config.peer_listen,
            self.key,
            config.peer_rate,
            config.idle_timeout,
        )
