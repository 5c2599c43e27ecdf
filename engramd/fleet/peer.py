"""Fill a set from the peer daemons that hold it: gRPC for the offers and grants, NIXL reads
for the bytes, several peers at once (swarmfill.py), each piece checked on its own.

The receiver asks the peers in an order of its own for each set (`spread`:
rendezvous hashing of set, receiver and peer), MAX_PEERS of them at once;
each must prove it holds the fleet's token and offer the set with digests
the fleet's key attested (peerstream.py). Pieces are then read from all of
them as swarm.Schedule decides, into the landing ring of a transfer process
of the fill's own (nixlxfer.Agent, landing.Landing), moved into the staged
set and compared there with the attested piece digests. Once every piece is
in, each tensor's strong digest and checksum must equal the attested ones and
random ranges must equal the node's own checkpoint (base.spot_check): a fill
that cannot get there fails, and the next source runs.
"""

from __future__ import annotations

import logging
import socket
import threading

import xxhash

from engramd.backings.regions import Region
from engramd.fleet.base import SourceFailed
from engramd.fleet.filling import FillingSets
from engramd.fleet.objstore import ObjectStoreSource
from engramd.fleet.peerstream import PeerStream
from engramd.fleet.swarmfill import MAX_PEERS, SwarmFill
from engramd.fleet.trust import FleetKey
from engramd.sets.seams import Filled, FillProgress
from engramd_shared.checkpoint import TablePlan

log = logging.getLogger("engramd")


def addresses(peers: list[str]) -> list[str]:
    """Each HOST:PORT of `peers` (entries may be comma-separated) with its host resolved.

    A name that resolves to several addresses (a headless Service over the
    DaemonSet) gives each; a name that does not resolve gives none (logged).
    """
    found: dict[str, None] = {}
    for entry in (p.strip() for item in peers for p in item.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not port.isdigit():
            log.warning("peer %r is not HOST:PORT; skipped", entry)
            continue
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("peer %s does not resolve (%s); skipped", entry, e)
            continue
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            found[f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"] = None
    return list(found)


def spread(peers: list[str], set_id: str, receiver: str) -> list[str]:
    """`peers` in the order `receiver` tries them for `set_id`: rendezvous hashing.

    Each (set, receiver, peer) gets a score, XXH3-64 of the three; the peers are tried
    highest first. Every node of a fleet (`receiver`: its identity) thus has an order of its own
    for each set, the same at every try, and among N warm peers each is the first
    choice of about 1/N of the receivers: a headless Service's first address is not
    everyone's source. A peer added or gone moves only the receivers that ranked it.
    """

    def score(peer: str) -> int:
        return xxhash.xxh3_64_intdigest(f"{set_id}\0{receiver}\0{peer}".encode())

    return sorted(peers, key=score, reverse=True)


def is_local(address: str) -> bool:
    """Whether HOST:PORT's host is an address of this node (in its network namespace)."""
    host = address.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


class PeerSource:
    """Fills sets from peers; one fill at a time. `own`: this daemon's --peer-listen, which
    a list of the fleet's peers (a headless Service) names too: it is never asked."""

    def __init__(
        self,
        peers: list[str],
        key: FleetKey,
        min_rate: int,
        filling: FillingSets,
        own: str = "",
    ) -> None:
        self._peers = peers
        self._key = key
        self._min_rate = min_rate
        self._filling = filling
        self._own_port = own.rpartition(":")[2]
        #: This node among the fleet's, for the orders of peers and pieces: its host name and
        #: its peer address (host names alone may repeat: cloned machines, shared namespaces).
        self._receiver = f"{socket.gethostname()} {own}" if own else socket.gethostname()
        self._lock = threading.Lock()

    def addresses(self, set_id: str) -> list[str]:
        """The peers to try for a set, resolved now (a Service's members change), in this
        node's order for that set (spread), this daemon's own peer port left out."""
        found = [
            a
            for a in addresses(self._peers)
            if not (self._own_port and a.rpartition(":")[2] == self._own_port and is_local(a))
        ]
        return spread(found, set_id, self._receiver)

    def vouch(self, plan: TablePlan) -> None:
        """Return when a peer offers the set of `plan` under an attestation of the fleet's key
        that covers it (peerstream's checks of an offer); SourceFailed naming why each peer
        did not. Nothing of the set is reserved before."""
        found = self.addresses(plan.set_id)[:MAX_PEERS]
        why = []
        for address in found:
            stream = PeerStream(address)
            try:
                stream.open(plan, self._key)
                return
            except SourceFailed as e:
                why.append(f"{address}: {e}")
            finally:
                stream.close()
        raise SourceFailed("; ".join(why) or "no peer address resolves")

    def fill(
        self,
        plan: TablePlan,
        regions: list[Region],
        progress: FillProgress,
        store: ObjectStoreSource | None = None,
    ) -> Filled:
        """Read the set of `plan` from the peers into `regions`; the digests and the
        attestation they matched. `store`: the object store, a source of pieces beside the
        peers; pieces no peer and no store can give come from the node's own files.

        Raises SourceFailed (with the reason in one line) when no peer offers the
        set, or the peers cannot give every piece; the regions' contents are then
        undefined.
        """
        with self._lock:
            found = self.addresses(plan.set_id)[:MAX_PEERS]
            if not found:
                raise SourceFailed("no peer address resolves")
            fill = SwarmFill(
                plan,
                regions,
                progress,
                self._key,
                self._min_rate,
                self._filling,
                store,
                self._receiver,
            )
            return fill.run(found)
