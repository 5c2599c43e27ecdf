"""A receiver of its own making: open a fill with a token of its choice and say what it got.

    python tests/support/peer_probe.py HOST:PORT SET_ID TOKEN_FILE

Sends FillOpen (the set id, a nonce), checks the server's proof against its
own token, sends its proof under that token whatever the server's was,
and prints one JSON line: {"server_proven": bool, "code": the status code
name or "OK", "details": ..., "offered": bool, "attestation": the offer's,
"strong": the offer's strong digests}.
"""

from __future__ import annotations

import json
import queue
import sys
from collections.abc import Iterator
from typing import Any

import grpc

from engramd.fleet.trust import FleetKey, nonce, proven
from engramd_shared.pb import peer_pb2, peer_pb2_grpc


def main() -> int:
    address, set_id, token_file = sys.argv[1:4]
    with open(token_file) as f:
        key = FleetKey(f.read().strip())
    requests: queue.SimpleQueue[peer_pb2.FillRequest | None] = queue.SimpleQueue()

    def sent() -> Iterator[peer_pb2.FillRequest]:
        while (r := requests.get()) is not None:
            yield r

    mine = nonce()
    requests.put(peer_pb2.FillRequest(open=peer_pb2.FillOpen(set_id=set_id, nonce=mine)))
    out: dict[str, Any] = {
        "server_proven": False,
        "offered": False,
        "attestation": "",
        "strong": [],
    }
    with grpc.insecure_channel(address) as channel:
        replies = peer_pb2_grpc.PeerServiceStub(channel).Fill(sent(), timeout=30)
        try:
            first = next(replies)
            theirs = first.proof.nonce
            out["server_proven"] = proven(first.proof.proof, key.server_proof(set_id, mine, theirs))
            requests.put(peer_pb2.FillRequest(proof=key.client_proof(set_id, mine, theirs)))
            second = next(replies)
            out["offered"] = second.WhichOneof("step") == "offer"
            out["attestation"] = second.offer.attestation
            out["strong"] = list(second.offer.strong_digests)
            out["code"] = "OK"
        except grpc.RpcError as e:
            out["code"] = e.code().name if isinstance(e, grpc.Call) else "error"
            out["details"] = e.details() if isinstance(e, grpc.Call) else str(e)
        finally:
            requests.put(None)
            replies.cancel()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
