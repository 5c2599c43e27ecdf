"""Fill a set from a peer daemon that holds it: gRPC for the offer, NIXL reads for the bytes.

The receiver tries the peers in an order of its own for each set (`spread`:
rendezvous hashing of set, receiver and peer) and opens one PeerService.Fill
stream per peer tried, with the set id it computed from its own checkpoint
and a nonce. The peer must first
prove it holds the fleet's token (trust.py): one that cannot is told nothing
more. Then the receiver proves it holds the token too, and the peer offers
its manifest with the attestation of its digests, its NIXL agent's metadata
and each tensor's address; the receiver refuses an offer that is not this
set (set id, fingerprint, tensor names, dtypes, shapes, sizes) or whose
digests (checksums and strong digests) the fleet's key did not attest, then
asks for windows and reads each granted one into the landing ring of a
transfer process of the fill's own (nixlxfer.Agent, landing.Landing), from
which the daemon moves it into the staged set and digests it. Once every
byte is in, each tensor's strong digest and checksum must equal the attested
ones and random ranges must equal the node's own checkpoint
(base.spot_check): a peer that sends other bytes is refused, and the next
source runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Protocol

import grpc
import xxhash

from engramd.sources.base import Progress, SourceFailed, spot_check
from engramd.sources.inflight import InOrder
from engramd.sources.landing import Landing
from engramd.sources.nixlxfer import Agent
from engramd.sources.regions import Region
from engramd.sources.strong import pieces as strong_pieces
from engramd.sources.trust import Filled, FleetKey, check_received, nonce, proven
from engramd_shared.checkpoint import TablePlan
from engramd_shared.layout import Manifest, ManifestError
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")

#: Seconds a peer has to connect and prove the token, and then to offer the set.
OFFER_TIMEOUT_S = 10.0
#: Bytes a second the serving node digests its copy at, at least, before its first offer of
#: that copy (BLAKE3 on all its cores, api/peer.py): the offer may take that much longer.
OFFER_DIGEST_RATE = 1 << 30
#: Seconds a window may wait for its grant, or take, when no rate floor is set
#: (a peer gone silent).
WINDOW_TIMEOUT_S = 60.0
#: Windows read at once: the next is on the wire while one is digested.
READS_IN_FLIGHT = 4
#: Seconds of a fill after which its rate is judged against the floor.
FLOOR_AFTER_S = 2.0


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
    highest first. Every node of a fleet (its host name) thus has an order of its own
    for each set, the same at every try, and among N warm peers each is the first
    choice of about 1/N of the receivers: a headless Service's first address is not
    everyone's source. A peer added or gone moves only the receivers that ranked it.
    """

    def score(peer: str) -> int:
        return xxhash.xxh3_64_intdigest(f"{set_id}\0{receiver}\0{peer}".encode())

    return sorted(peers, key=score, reverse=True)


class PeerSource:
    """Fills sets from peers; one fill at a time, each with a transfer process of its own."""

    def __init__(self, peers: list[str], key: FleetKey, min_rate: int) -> None:
        self._peers = peers
        self._key = key
        self._min_rate = min_rate
        self._lock = threading.Lock()

    def addresses(self, set_id: str) -> list[str]:
        """The peers to try for a set, resolved now (a Service's members change), in this
        node's order for that set (spread)."""
        return spread(addresses(self._peers), set_id, socket.gethostname())

    def fill(
        self, address: str, plan: TablePlan, regions: list[Region], progress: Progress
    ) -> Filled:
        """Read the set of `plan` from the peer at `address` into `regions`; the digests and
        the attestation they matched.

        Raises SourceFailed (with the reason in one line) when the peer cannot,
        will not, or sends other bytes; the regions' contents are then undefined.
        """
        with self._lock, ThreadPoolExecutor(1, "engramd-recv") as starter:
            # The transfer process starts its backend and maps its landing ring while the
            # peer offers.
            starting = starter.submit(_receiving, address, regions)
            channel = grpc.insecure_channel(address)
            try:
                return self._fill(channel, starting, address, plan, progress)
            finally:
                channel.close()
                with contextlib.suppress(SourceFailed):
                    agent, landing = starting.result()
                    landing.close()
                    agent.close()

    def _fill(
        self,
        channel: grpc.Channel,
        starting: Future[tuple[Agent, Landing]],
        address: str,
        plan: TablePlan,
        progress: Progress,
    ) -> Filled:
        requests: queue.SimpleQueue[peer_pb2.FillRequest | None] = queue.SimpleQueue()

        def sent() -> Iterator[peer_pb2.FillRequest]:
            while (r := requests.get()) is not None:
                yield r

        mine = nonce()
        requests.put(peer_pb2.FillRequest(open=peer_pb2.FillOpen(set_id=plan.set_id, nonce=mine)))
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        replies = stub.Fill(sent())
        waited = OFFER_TIMEOUT_S
        timer = threading.Timer(waited, replies.cancel)
        timer.start()
        try:
            try:
                first = next(replies)
                if first.WhichOneof("step") != "proof" or not proven(
                    first.proof.proof,
                    self._key.server_proof(plan.set_id, mine, first.proof.nonce),
                ):
                    # Nothing token-derived has gone to it: it gets no proof of ours.
                    log.warning(
                        "peer %s could not prove it holds the fleet's token; refused", address
                    )
                    raise SourceFailed("it could not prove it holds the fleet's token")
                timer.cancel()
                waited = OFFER_TIMEOUT_S + sum(t.nbytes for t in plan.tensors) / OFFER_DIGEST_RATE
                timer = threading.Timer(waited, replies.cancel)
                timer.start()
                requests.put(
                    peer_pb2.FillRequest(
                        proof=self._key.client_proof(plan.set_id, mine, first.proof.nonce)
                    )
                )
                second = next(replies)
            except grpc.RpcError as e:
                raise SourceFailed(_rpc_reason(e, waited)) from None
            except StopIteration:
                raise SourceFailed("the peer ended the stream without an offer") from None
            finally:
                timer.cancel()
            if second.WhichOneof("step") != "offer":
                raise SourceFailed("the peer answered without an offer")
            offer = second.offer
            manifest, strong = _check_offer(plan, offer, self._key)
            agent, landing = starting.result()
            landing.expect(strong)
            remote = agent.add_remote(offer.nixl_metadata)
            # A window is a piece of the strong digest, digested as it lands.
            pieces = [
                (i, at, n) for i, t in enumerate(plan.tensors) for at, n in strong_pieces(t.nbytes)
            ]
            for _, _, n in pieces:
                requests.put(peer_pb2.FillRequest(window=n))
            self._read(replies, agent, landing, remote, offer, pieces, progress)
            got = landing.digests()
        finally:
            requests.put(None)
            replies.cancel()
        check_received([t.name for t in plan.tensors], strong, got, "the peer sent other bytes")
        for entry, region in zip(plan.tensors, landing.regions, strict=True):
            spot_check(entry, region.view())
        # Every byte has the attested strong digest: the attested checksums are theirs.
        return Filled([t.checksum for t in manifest.tensors], got, offer.attestation)

    def _read(
        self,
        replies: _Replies,
        agent: Agent,
        landing: Landing,
        remote: str,
        offer: peer_pb2.SetOffer,
        pieces: list[tuple[int, int, int]],
        progress: Progress,
    ) -> None:
        """Read each granted window, READS_IN_FLIGHT at a time, each into a slot of the
        landing ring, moved into the staged set once it is in."""
        started = time.monotonic()
        done = 0

        def landed(slot: int, index: int, at: int, n: int) -> None:
            nonlocal done
            landing.landed(slot, index, at)
            done += n
            elapsed = time.monotonic() - started
            if self._min_rate and elapsed > FLOOR_AFTER_S and done / elapsed < self._min_rate:
                raise SourceFailed(
                    f"too slow: {done / elapsed / 1e6:.0f} MB/s, below the floor of "
                    f"{self._min_rate / 1e6:.0f} MB/s (--peer-min-rate)"
                )

        reads = InOrder(agent, progress, READS_IN_FLIGHT, "the peer")
        for index, at, n in pieces:
            reply = _next_grant(replies)
            if reply.granted != n:
                raise SourceFailed("the peer granted another window than asked for")
            slot, there = landing.slot()
            handle = agent.post(
                [(there, n, 0)],
                [(offer.regions[index].address + at, n, 0)],
                "DRAM",
                remote,
            )
            deadline = time.monotonic() + (
                max(n / self._min_rate, 1.0) * (READS_IN_FLIGHT + 3)
                if self._min_rate
                else WINDOW_TIMEOUT_S
            )
            reads.add(handle, n, deadline, partial(landed, slot, index, at, n))
        reads.finish()


def _receiving(address: str, regions: list[Region]) -> tuple[Agent, Landing]:
    """A transfer process for a fill from `address`, and its landing ring for `regions`."""
    agent = Agent({"UCX": {}}, peer=address)
    try:
        return agent, Landing(agent, regions, READS_IN_FLIGHT)
    except BaseException:
        agent.close()
        raise


class _Replies(Protocol):
    """The reply stream of a Fill call: its messages, and a way to cancel it."""

    def __next__(self) -> peer_pb2.FillReply: ...

    def __iter__(self) -> Iterator[peer_pb2.FillReply]: ...

    def cancel(self) -> bool: ...


def _check_offer(
    plan: TablePlan, offer: peer_pb2.SetOffer, key: FleetKey
) -> tuple[Manifest, list[str]]:
    """The peer's manifest and strong digests, once they proved to describe the set of `plan`
    with digests the fleet's key attested: the bytes read must then have exactly those."""
    try:
        manifest = Manifest.from_json(offer.manifest_json)
    except (ManifestError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise SourceFailed(f"the peer's manifest does not parse ({e})") from None
    if manifest.set_id != plan.set_id or manifest.fingerprint != plan.fingerprint:
        raise SourceFailed(f"the peer offered set {manifest.set_id}, not {plan.set_id}")
    theirs = [(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in manifest.tensors]
    mine = [(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in plan.tensors]
    if theirs != mine or len(offer.regions) != len(mine):
        raise SourceFailed("the peer's set has other tensors than this checkpoint's")
    if any(r.nbytes != t.nbytes for r, t in zip(offer.regions, plan.tensors, strict=True)):
        raise SourceFailed("the peer's regions are not the tensors' sizes")
    strong = list(offer.strong_digests)
    if not strong and manifest.tensors:
        raise SourceFailed(
            "the peer's offer carries no strong digests (an engramd that attests checksums "
            "alone): upgrade it"
        )
    if not key.attested(
        offer.attestation, manifest.set_id, manifest.fingerprint, manifest.tensors, strong
    ):
        raise SourceFailed(
            "the peer's digests carry no valid attestation of the fleet's key (no node that "
            "loaded the set from its files made them, or the token changed since)"
        )
    return manifest, strong


def _next_grant(replies: _Replies) -> peer_pb2.FillReply:
    """The peer's next grant; a peer silent for WINDOW_TIMEOUT_S has its stream cancelled."""
    watchdog = threading.Timer(WINDOW_TIMEOUT_S, replies.cancel)
    watchdog.start()
    try:
        return next(replies)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        reason = (
            f"no grant within {WINDOW_TIMEOUT_S:.0f} s"
            if code is grpc.StatusCode.CANCELLED
            else _rpc_reason(e)
        )
        raise SourceFailed(f"the peer's stream broke mid-fill ({reason})") from None
    except StopIteration:
        raise SourceFailed("the peer's stream ended mid-fill") from None
    finally:
        watchdog.cancel()


def _rpc_reason(e: grpc.RpcError, waited: float = OFFER_TIMEOUT_S) -> str:
    code = e.code() if isinstance(e, grpc.Call) else None
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    if code is grpc.StatusCode.CANCELLED:
        return f"no offer within {waited:.0f} s"
    return f"{code.name if code else 'error'}: {details}"
