"""A rogue PeerService at a --peers address: it holds only the public checkpoint, no token.

    python tests/support/rogue_peer.py HOST:PORT CHECKPOINT MODE [UPSTREAM]

It copies the checkpoint's tables into memory registered with a NIXL agent
of its own, zeroes one 256-byte row in the middle of the first tensor and
offers that copy with a manifest whose XXH3 digests are the altered bytes'
(the attack of issue 43, item 4). MODE says how it answers a FillOpen:

- `legacy`: with the offer at once, as a server of the old protocol did;
- `forged`: with a ServerProof of random bytes (it cannot make a real one),
  and the offer after any proof the receiver sends.
- `relay-*`: as a relay between the receiver and the real daemon at
  UPSTREAM (HOST:PORT): the handshake is not bound to the connection, so it
  passes the FillOpen and both proofs along, takes the real offer and offers
  the receiver its altered copy under it: the real manifest (the genuine
  XXH3 checksums) and attestation, its own NIXL agent and regions, and as
  strong and piece digests none (`relay-checksums`: the offer of a protocol
  that attested checksums alone), its copy's own (`relay-own-strong`), or
  the real offer's (`relay-genuine`: what bytes built to share the genuine
  XXH3 would claim); `relay-liar` is `relay-genuine` with a row zeroed in
  every tensor (a peer among honest ones that lies about every piece of a
  small set); `relay-unregistered` is `relay-genuine` offering regions
  1 TiB past its registered memory (NIXL refuses to start any read of
  them).

Every window and piece asked for is granted, so a receiver that trusted it would
publish the altered row. Prints {"listening": ..., "row": offset} once
serving; on the command `captured` answers {"requests": [hex of each
request received, serialized], "kinds": [...], "nonce": hex of the
ServerProof nonce it sent}. Stops when stdin closes.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from engramd.strong import digest_views
from engramd_shared.checkpoint import plan_tables
from engramd_shared.layout import Manifest, ManifestTensor, tensor_file_name
from engramd_shared.pb import peer_pb2, peer_pb2_grpc

#: The row it zeroes: as wide as a row of the synthetic tables (dim 256, one byte each).
ROW_BYTES = 256


class Rogue(peer_pb2_grpc.PeerServiceServicer):
    """Offers an altered copy to anyone, records what it is sent."""

    def __init__(self, checkpoint: str, mode: str, upstream: str) -> None:
        self.mode = mode
        self.upstream = upstream
        plan = plan_tables(checkpoint)
        sizes = [t.nbytes for t in plan.tensors]
        self._memory = mmap.mmap(-1, sum(sizes))
        view = memoryview(self._memory)
        at = 0
        starts = []
        for t in plan.tensors:
            starts.append(at)
            for span in t.spans:
                with open(span.file, "rb") as f:
                    f.seek(span.offset)
                    view[at : at + span.nbytes] = f.read(span.nbytes)
                at += span.nbytes
        first = plan.tensors[0]
        self.row = (first.nbytes // 2) // ROW_BYTES * ROW_BYTES
        view[self.row : self.row + ROW_BYTES] = bytes(ROW_BYTES)
        if mode == "relay-liar":
            for t, start in zip(plan.tensors, starts, strict=True):
                row = start + (t.nbytes // 2) // ROW_BYTES * ROW_BYTES
                if t.nbytes >= ROW_BYTES:
                    view[row : row + ROW_BYTES] = bytes(ROW_BYTES)
        own = digest_views([view[s : s + n] for s, n in zip(starts, sizes, strict=True)])
        self._own_strong = own.strong
        self._own_pieces = [b"".join(ds) for ds in own.pieces]
        tensors = tuple(
            ManifestTensor(
                name=t.name,
                dtype=t.dtype,
                shape=tuple(t.shape),
                file=tensor_file_name(i),
                offset=0,
                nbytes=t.nbytes,
                checksum=checksum,
            )
            for i, (t, checksum) in enumerate(zip(plan.tensors, own.checksums, strict=True))
        )
        manifest = Manifest(
            set_id=plan.set_id,
            fingerprint=plan.fingerprint,
            nonce=secrets.token_hex(16),
            checkpoint=str(plan.checkpoint),
            selection=plan.selection,
            created=time.time(),
            tensors=tensors,
            sources=plan.sources,
        )
        base = _address(self._memory)
        api = _nixl()
        self._agent = api.nixl_agent(
            f"rogue-{secrets.token_hex(4)}",
            api.nixl_agent_config(enable_listen_thread=False, backends=["UCX"]),
        )
        self._registered = self._agent.register_memory([(base, len(self._memory), 0, "")], "DRAM")
        self._offer = peer_pb2.SetOffer(
            manifest_json=manifest.to_json(),
            nixl_metadata=self._agent.get_agent_metadata(),
            regions=[
                peer_pb2.RemoteRegion(address=base + s, nbytes=n)
                for s, n in zip(starts, sizes, strict=True)
            ],
            # What a token holder would send; it has none, so these are random bytes.
            attestation=f"hmac-sha256:{secrets.token_hex(32)}",
        )
        self._lock = threading.Lock()
        self.requests: list[peer_pb2.FillRequest] = []
        self.nonce = b""

    def _record(self, request: peer_pb2.FillRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def Fill(
        self, request_iterator: Iterator[peer_pb2.FillRequest], context: Any
    ) -> Iterator[peer_pb2.FillReply]:
        """Offer the altered copy (after a forged proof in `forged` mode); grant every window."""
        first = next(request_iterator, None)
        if first is None:
            return
        self._record(first)
        if self.mode.startswith("relay-"):
            yield from self._relay(first, request_iterator)
            return
        if self.mode == "legacy":
            yield peer_pb2.FillReply(offer=self._offer)
        else:
            self.nonce = secrets.token_bytes(32)
            yield peer_pb2.FillReply(
                proof=peer_pb2.ServerProof(nonce=self.nonce, proof=secrets.token_bytes(32))
            )
        for request in request_iterator:
            self._record(request)
            step = request.WhichOneof("step")
            if step == "proof":
                yield peer_pb2.FillReply(offer=self._offer)
            elif step == "window":
                yield peer_pb2.FillReply(granted=request.window)
            elif step == "piece":
                yield peer_pb2.FillReply(piece=request.piece)

    def _relay(
        self, first: peer_pb2.FillRequest, request_iterator: Iterator[peer_pb2.FillRequest]
    ) -> Iterator[peer_pb2.FillReply]:
        """Pass the handshake between the receiver and the real daemon, then offer the altered
        copy under the real offer's manifest and attestation; grant every window."""
        upstream: queue.SimpleQueue[peer_pb2.FillRequest | None] = queue.SimpleQueue()

        def sent() -> Iterator[peer_pb2.FillRequest]:
            while (r := upstream.get()) is not None:
                yield r

        with grpc.insecure_channel(self.upstream) as channel:
            replies = peer_pb2_grpc.PeerServiceStub(channel).Fill(sent(), timeout=60)
            try:
                upstream.put(first)
                yield next(replies)  # the real daemon's proof
                theirs = next(request_iterator, None)
                if theirs is None:
                    return
                self._record(theirs)
                upstream.put(theirs)
                real = next(replies).offer
            finally:
                upstream.put(None)
                replies.cancel()
        strong, pieces = {
            "relay-checksums": ([], []),
            "relay-own-strong": (self._own_strong, self._own_pieces),
            "relay-genuine": (list(real.strong_digests), list(real.piece_digests)),
            "relay-liar": (list(real.strong_digests), list(real.piece_digests)),
            "relay-unregistered": (list(real.strong_digests), list(real.piece_digests)),
        }[self.mode]
        regions = list(self._offer.regions)
        if self.mode == "relay-unregistered":
            regions = [
                peer_pb2.RemoteRegion(address=r.address + (1 << 40), nbytes=r.nbytes)
                for r in regions
            ]
        yield peer_pb2.FillReply(
            offer=peer_pb2.SetOffer(
                manifest_json=real.manifest_json,
                attestation=real.attestation,
                strong_digests=strong,
                piece_digests=pieces,
                nixl_metadata=self._offer.nixl_metadata,
                regions=regions,
            )
        )
        for request in request_iterator:
            self._record(request)
            if request.WhichOneof("step") == "window":
                yield peer_pb2.FillReply(granted=request.window)
            elif request.WhichOneof("step") == "piece":
                yield peer_pb2.FillReply(piece=request.piece)


def _nixl() -> Any:
    for build in ("nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{build}._api")
        except ImportError:
            continue
    raise SystemExit("NIXL is not installed")


def _address(memory: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(memory))


def main() -> int:
    listen, checkpoint, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    upstream = sys.argv[4] if len(sys.argv) > 4 else ""
    # NIXL logs on stdout: the answers get a descriptor of their own, the rest goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(doc: dict[str, Any]) -> None:
        answers.write(json.dumps(doc) + "\n")

    rogue = Rogue(checkpoint, mode, upstream)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    peer_pb2_grpc.add_PeerServiceServicer_to_server(rogue, server)
    server.add_insecure_port(listen)
    server.start()
    say({"listening": listen, "row": rogue.row, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip() == "captured":
            with rogue._lock:
                requests = list(rogue.requests)
            say(
                {
                    "requests": [r.SerializeToString().hex() for r in requests],
                    "kinds": [r.WhichOneof("step") for r in requests],
                    "nonce": rogue.nonce.hex(),
                }
            )
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
