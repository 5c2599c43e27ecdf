"""Open a Fill on a daemon's peer port as a holder of the fleet's token: the attacker of
tests/daemon/test_fleet_exposure.py who is a fleet member.

The one place the tests speak the Fill handshake from the receiver's side, the
way engramd/fleet/peer.py's PeerSource does: a change to the handshake
changes `open_fill` and nothing else.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from engramd.fleet.trust import FleetKey, nonce
from engramd_shared.pb import peer_pb2, peer_pb2_grpc


class OpenFill:
    """A Fill stream past its offer: the offer, and windows asked for one at a time."""

    def __init__(
        self,
        channel: grpc.Channel,
        requests: queue.SimpleQueue[peer_pb2.FillRequest | None],
        replies: Iterator[peer_pb2.FillReply],
        offer: peer_pb2.SetOffer,
    ) -> None:
        self._channel = channel
        self._requests = requests
        self._replies = replies
        #: What the serving daemon offered: manifest, NIXL metadata, each tensor's address.
        self.offer = offer

    def ask(self, nbytes: int) -> None:
        """Ask for a window of `nbytes`, without waiting for the answer."""
        self._requests.put(peer_pb2.FillRequest(window=nbytes))

    def piece(self, piece: int) -> peer_pb2.FillReply:
        """Ask for piece `piece` and return the daemon's answer (news of pieces held skipped)."""
        self._requests.put(peer_pb2.FillRequest(piece=piece))
        while (reply := self.reply()).WhichOneof("step") == "holding":
            pass
        return reply

    def done(self, piece: int) -> None:
        """Say the read of piece `piece` ended (whether or not it was granted here)."""
        self._requests.put(peer_pb2.FillRequest(done=piece))

    def reply(self) -> peer_pb2.FillReply:
        """The daemon's next answer (a grant); raises grpc.RpcError where it ended the stream."""
        return next(self._replies)

    def window(self, nbytes: int) -> peer_pb2.FillReply:
        """Ask for a window of `nbytes` and return the daemon's answer."""
        self.ask(nbytes)
        return self.reply()

    def close(self) -> None:
        """End the stream and the channel."""
        self._requests.put(None)
        self._channel.close()


def own_channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own: the peer caps streams per connection."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def open_fill(
    address: str,
    token: str,
    set_id: str,
    timeout: float = 60.0,
    channel: grpc.Channel | None = None,
) -> OpenFill:
    """Open a Fill of `set_id` on the peer port at `address` (HOST:PORT) with `token`, as
    PeerSource does (the server's proof taken on trust, its own under the token), for a
    stream of at most `timeout` seconds; returns once the daemon offered the set (raises
    grpc.RpcError when it refused, ValueError when it answered something else)."""
    requests: queue.SimpleQueue[peer_pb2.FillRequest | None] = queue.SimpleQueue()

    def sent() -> Iterator[peer_pb2.FillRequest]:
        while (r := requests.get()) is not None:
            yield r

    channel = channel or grpc.insecure_channel(address)
    key, mine = FleetKey(token), nonce()
    requests.put(peer_pb2.FillRequest(open=peer_pb2.FillOpen(set_id=set_id, nonce=mine)))
    replies = peer_pb2_grpc.PeerServiceStub(channel).Fill(sent(), timeout=timeout)
    try:
        first = next(replies)
        if first.WhichOneof("step") == "proof":
            theirs = first.proof.nonce
            requests.put(peer_pb2.FillRequest(proof=key.client_proof(set_id, mine, theirs)))
            first = next(replies)
    except BaseException:
        requests.put(None)
        channel.close()
        raise
    if first.WhichOneof("step") != "offer":
        requests.put(None)
        channel.close()
        raise ValueError(f"the daemon answered the open with {first.WhichOneof('step')}")
    return OpenFill(channel, requests, replies, first.offer)
