"""One PeerService.Fill stream, the receiver's end: the handshake, the offer checked against
the fleet's key, then piece requests and the peer's replies.

The receiver opens the stream with the set id it computed from its own
checkpoint and a nonce. The peer must first prove it holds the fleet's token
(trust.py): one that cannot is told nothing more. Then the receiver proves
it holds the token too, and the peer offers its manifest with the
attestation of its digests, each piece's digest, the pieces it holds, its
NIXL agent's metadata and each tensor's address. An offer that is not this
set (set id, fingerprint, tensor names, dtypes, shapes, sizes), whose
digests (checksums and strong digests) the fleet's key did not attest, or
whose piece digests do not hash to the attested strong digests is refused.
After that, `ask` sends a request for a piece, and a thread of the stream's
own hands each reply (a grant, a piece not held, news of more pieces held)
to the fill as an event, and the stream's end as one too.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from engramd.fleet.base import SourceFailed
from engramd.fleet.filling import bits, indices
from engramd.fleet.trust import FleetKey, nonce, proven
from engramd.strong import set_pieces, split_pieces
from engramd_shared.checkpoint import TablePlan
from engramd_shared.layout import Manifest, ManifestError
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

log = logging.getLogger("engramd")

#: Seconds a peer has to connect and prove the token, and then to offer the set.
OFFER_TIMEOUT_S = 10.0
#: Bytes a second the serving node digests its copy at, at least, before its first offer of
#: that copy (BLAKE3 on all its cores, fleet/peerservice.py): the offer may take that much longer.
OFFER_DIGEST_RATE = 1 << 30


class _Replies(Protocol):
    """The reply stream of a Fill call: its messages, and a way to cancel it."""

    def __next__(self) -> peer_pb2.FillReply: ...

    def __iter__(self) -> Iterator[peer_pb2.FillReply]: ...

    def cancel(self) -> bool: ...


class PeerStream:
    """The receiver's end of one Fill stream with the peer at `address`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._requests: queue.SimpleQueue[peer_pb2.FillRequest | None] = queue.SimpleQueue()
        self._replies: _Replies | None = None
        #: Set by `open`: the peer's offer, its manifest, and the pieces it holds.
        self.offer = peer_pb2.SetOffer()
        self.manifest: Manifest | None = None
        #: The pieces it said it holds, as filling.bits: news is compared with it.
        self.known = 0
        #: Each tensor's piece digests, checked against the attested strong digests.
        self.pieces: list[list[bytes]] = []
        #: The peer's NIXL agent, once the fill loaded its metadata.
        self.remote = ""
        #: A receiving transfer process that ended had loaded its metadata (`remote` was set).
        self.loaded_before = False

    def _sent(self) -> Iterator[peer_pb2.FillRequest]:
        while (r := self._requests.get()) is not None:
            yield r

    def open(self, plan: TablePlan, key: FleetKey) -> None:
        """The handshake and the offer; raises SourceFailed (the reason in one line) when the
        peer cannot, will not, or offers something else than this set attested."""
        mine = nonce()
        self._requests.put(
            peer_pb2.FillRequest(open=peer_pb2.FillOpen(set_id=plan.set_id, nonce=mine))
        )
        replies: _Replies = peer_pb2_grpc.PeerServiceStub(self._channel).Fill(self._sent())
        self._replies = replies
        waited = OFFER_TIMEOUT_S
        timer = threading.Timer(waited, replies.cancel)
        timer.start()
        try:
            first = next(replies)
            if first.WhichOneof("step") != "proof" or not proven(
                first.proof.proof, key.server_proof(plan.set_id, mine, first.proof.nonce)
            ):
                # Nothing token-derived has gone to it: it gets no proof of ours.
                log.warning(
                    "peer %s could not prove it holds the fleet's token; refused", self.address
                )
                raise SourceFailed("it could not prove it holds the fleet's token")
            timer.cancel()
            waited = OFFER_TIMEOUT_S + sum(t.nbytes for t in plan.tensors) / OFFER_DIGEST_RATE
            timer = threading.Timer(waited, replies.cancel)
            timer.start()
            self._requests.put(
                peer_pb2.FillRequest(proof=key.client_proof(plan.set_id, mine, first.proof.nonce))
            )
            second = next(replies)
        except grpc.RpcError as e:
            raise SourceFailed(rpc_reason(e, f"no offer within {waited:.0f} s")) from None
        except StopIteration:
            raise SourceFailed("the peer ended the stream without an offer") from None
        finally:
            timer.cancel()
        if second.WhichOneof("step") != "offer":
            raise SourceFailed("the peer answered without an offer")
        self.offer = second.offer
        self.manifest, self.pieces = check_offer(plan, self.offer, key)
        try:
            self.known = bits(self.offer.held, len(set_pieces([t.nbytes for t in plan.tensors])))
        except ValueError as e:
            raise SourceFailed(
                f"the peer's offer names the pieces it holds wrongly ({e})"
            ) from None

    @property
    def held(self) -> list[int]:
        """The pieces it said it holds."""
        return indices(self.known)

    @property
    def strong(self) -> list[str]:
        """The attested strong digests of the offer."""
        return list(self.offer.strong_digests)

    def news(self, held: bytes, count: int) -> list[int]:
        """The pieces a `holding` reply names that the peer did not hold before (ValueError
        when it is no bitmap of `count` pieces)."""
        now = bits(held, count)
        new, self.known = now & ~self.known, self.known | now
        return indices(new)

    def ask(self, piece: int) -> None:
        """Ask for piece `piece` (its grant, or that it is not held, comes as an event)."""
        self._requests.put(peer_pb2.FillRequest(piece=piece))

    def done(self, piece: int) -> None:
        """The read of granted piece `piece` ended: the peer's serving slot is free."""
        self._requests.put(peer_pb2.FillRequest(done=piece))

    def listen(self, put: Callable[[Replied | StreamEnded], None]) -> None:
        """From now on `put` a Replied for each reply, and a StreamEnded once the stream
        ends; on a thread of its own."""
        threading.Thread(
            target=self._listen, args=(put,), name="engramd-peer-stream", daemon=True
        ).start()

    def _listen(self, put: Callable[[Replied | StreamEnded], None]) -> None:
        assert self._replies is not None
        try:
            for reply in self._replies:
                put(Replied(self, reply))
            why = "the peer's stream ended mid-fill"
        except grpc.RpcError as e:
            why = f"the peer's stream broke mid-fill ({rpc_reason(e, 'cancelled')})"
        put(StreamEnded(self, why))

    def close(self) -> None:
        """End the stream."""
        self._requests.put(None)
        if self._replies is not None:
            self._replies.cancel()
        self._channel.close()


@dataclass(frozen=True)
class Replied:
    """A peer's stream answered (a grant, a piece not held, what it holds now)."""

    stream: PeerStream
    reply: peer_pb2.FillReply


@dataclass(frozen=True)
class StreamEnded:
    """A peer's stream ended, and why."""

    stream: PeerStream
    why: str


def check_offer(
    plan: TablePlan, offer: peer_pb2.SetOffer, key: FleetKey
) -> tuple[Manifest, list[list[bytes]]]:
    """The peer's manifest and each tensor's piece digests, once they proved to describe the
    set of `plan` with digests the fleet's key attested: the bytes read must then have exactly
    those."""
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
    if len(offer.piece_digests) != len(plan.tensors):
        raise SourceFailed(
            "the peer's offer carries no piece digests (an engramd that serves whole sets "
            "only): upgrade it"
        )
    try:
        pieces = [
            split_pieces(joined, t.nbytes, digest)
            for joined, t, digest in zip(offer.piece_digests, plan.tensors, strong, strict=True)
        ]
    except ValueError as e:
        raise SourceFailed(f"the peer's piece digests are not the attested ones ({e})") from None
    return manifest, pieces


def rpc_reason(e: grpc.RpcError, cancelled: str) -> str:
    """One line for a failed call; `cancelled`: what a cancelled one means here."""
    code = e.code() if isinstance(e, grpc.Call) else None
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    if code is grpc.StatusCode.CANCELLED:
        return cancelled
    if code is grpc.StatusCode.UNAVAILABLE and details.startswith("failed to connect"):
        # No daemon answered: the network's side (or no daemon there), not the peer's answer.
        return (
            f"UNAVAILABLE: the network: this node cannot reach the peer ({details}); check that "
            "its daemon serves --peer-listen on that address and that the route and firewall "
            "between the nodes let TCP through"
        )
    return f"{code.name if code else 'error'}: {details}"
