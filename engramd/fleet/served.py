"""What a peer stream serves (a published copy, or the held pieces of a set being filled)
and the digests a receiver checks it with.

A set this node loaded from its files gets its strong and piece digests from
its published copy's pages on the first offer of that copy (on a thread of
their own, every core hashing), kept for later offers: a copy never changes
once published. A set this node filled is offered with the origin's strong
digests and attestation, kept in its manifest (its pages are hashed on the
first offer too, for the piece digests, and must give the attested strong
digests). A set this node is filling from peers is offered with what its
origin offered (filling.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from engramd.backings.regions import Region, close_all
from engramd.fleet.filling import Filling, FillingSets
from engramd.fleet.trust import FleetKey
from engramd.host.blocking import BlockingPool
from engramd.sets.store import SetStore
from engramd.sets.tableset import TableSet
from engramd.strong import Digests, digest_views, set_pieces
from engramd.units import gib
from engramd_shared.errors import UnknownSet

log = logging.getLogger("engramd")


@dataclass(frozen=True)
class Offered:
    """What a receiver checks a copy with: the attestation, each tensor's strong digest and
    its pieces' digests (32 bytes each, back to back)."""

    attestation: str
    strong: list[str]
    pieces: list[bytes]


class Served:
    """What one stream serves: a published copy, or the held pieces of a set being filled."""

    def __init__(
        self,
        name: str,
        key: str,
        manifest_json: str,
        offered: Offered,
        memory: Callable[[], list[tuple[int, int, int]]],
        pieces: list[int],
        filling: Filling | None,
    ) -> None:
        self.name = name
        #: What a transfer process serving it is shared by: this copy, as loaded or filled.
        self.key = key
        self.manifest_json = manifest_json
        self.offered = offered
        #: Each tensor's (fd, offset, bytes), with descriptors of the caller's own.
        self.memory = memory
        #: Each piece's bytes.
        self.pieces = pieces
        self.nbytes = sum(pieces)
        self.filling = filling
        self.told = -1

    def held(self) -> bytes:
        """The bitmap of the pieces held now (b"": all); remembered as told."""
        if self.filling is None:
            return b""
        self.told, held = self.filling.held()
        return held

    def news(self) -> bytes | None:
        """The held bitmap if more pieces are held than the receiver was told of."""
        if self.filling is None or self.filling.version == self.told:
            return None
        return self.held()


class Offers:
    """The sets this node offers peers: its published copies, with their digests taken once
    per copy, else the fills in progress here."""

    def __init__(self, store: SetStore, key: FleetKey, filling: FillingSets) -> None:
        self._store = store
        self._key = key
        self._filling = filling
        # One copy digested at a time, each on every core: an Export is never queued behind.
        self._digesting = BlockingPool("peer-digest", 1)
        #: The digests of each published copy, by (copy, its manifest's nonce): a published
        #: copy's bytes never change, and a copy loaded again has another nonce.
        self._offered: dict[tuple[str, str], asyncio.Future[Offered]] = {}

    async def served(self, set_id: str) -> Served:
        """The published copy of `set_id`, else its fill in progress here."""
        ts = self._store.offered(set_id)
        if ts is not None:
            assert ts.manifest is not None
            tensors = ts.manifest.tensors
            return Served(
                ts.copy,
                f"{ts.copy} {ts.manifest.nonce}",
                ts.manifest.to_json(),
                await self._offer_of(ts),
                lambda: published_memory(ts),
                [n for _, _, n in set_pieces([t.nbytes for t in tensors])],
                None,
            )
        filling = self._filling.get(set_id)
        if filling is None:
            # The same answer for a set not held and one only a worker's attach loaded.
            raise UnknownSet(f"this daemon serves no published set {set_id} to peers")
        return Served(
            f"{set_id} (filling)",
            f"{set_id} filling {id(filling)}",
            filling.manifest_json,
            Offered(filling.attestation, filling.strong, filling.piece_digests),
            filling.descriptors,
            filling.sizes,
            filling,
        )

    async def _offer_of(self, ts: TableSet) -> Offered:
        """The attestation and digests a receiver checks the copy with, from its pages. A set
        this node filled keeps the origin's attestation (never signed again here), and its
        pages must give the attested strong digests; a set loaded from files is attested here
        (this node took its digests from its files)."""
        manifest = ts.manifest
        assert manifest is not None
        if manifest.attestation is not None and manifest.strong_digests is None:
            # Filled by an engramd that attested checksums alone: nothing to forward.
            raise UnknownSet(
                f"set {manifest.set_id} was filled by an older engramd that kept no strong "
                "digests; it is not served to peers until it is dropped and loaded again"
            )
        key = (ts.copy, manifest.nonce)
        digesting = self._offered.get(key)
        if digesting is None:
            # An earlier load of this copy is gone; its digests never count again.
            for old in [k for k in self._offered if k[0] == ts.copy]:
                del self._offered[old]
            digesting = asyncio.ensure_future(self._digest(ts))
            self._offered[key] = digesting

            def forget(done: asyncio.Future[Offered]) -> None:
                # A failed digest (the copy dropped meanwhile) is tried again next time.
                if (done.cancelled() or done.exception()) and self._offered.get(key) is done:
                    del self._offered[key]

            digesting.add_done_callback(forget)
        # Shielded: a stream that ends while its copy is hashed leaves the digest to the next.
        return await asyncio.shield(digesting)

    async def _digest(self, ts: TableSet) -> Offered:
        manifest = ts.manifest
        assert manifest is not None
        started = time.monotonic()
        got = await self._digesting.run(copy_digests, ts)
        log.info(
            "set %s: strong digests of its %s taken for peers in %.2f s",
            ts.copy,
            gib(manifest.nbytes),
            time.monotonic() - started,
        )
        pieces = [b"".join(ds) for ds in got.pieces]
        if manifest.attestation is not None:
            return Offered(manifest.attestation, got.strong, pieces)
        attested = self._key.attest(
            manifest.set_id, manifest.fingerprint, manifest.tensors, got.strong
        )
        return Offered(attested, got.strong, pieces)


def published_memory(ts: TableSet) -> list[tuple[int, int, int]]:
    """Each tensor of a published copy as (fd, offset, bytes), with descriptors of the
    caller's own (to close)."""
    assert ts.manifest is not None
    opened = ts.backing.descriptors(ts.manifest)
    fds = dict(opened)
    memory = [(os.dup(fds[t.file]), t.offset, t.nbytes) for t in ts.manifest.tensors]
    for _, fd in opened:
        os.close(fd)
    return memory


def copy_digests(ts: TableSet) -> Digests:
    """Each tensor's checksum, strong digest and pieces' digests, from the pages of the
    published copy `ts` (mapped read-only here while they are hashed), of the kinds its
    manifest names.

    Raises UnknownSet when a tensor's bytes lost the checksum they were loaded
    with, or (a filled set) the attested strong digest: a copy changed since
    is never offered (a receiver checks only attested digests).
    """
    manifest = ts.manifest
    assert manifest is not None
    opened = ts.backing.descriptors(manifest)
    regions: list[Region] = []
    try:
        fds = dict(opened)
        for t in manifest.tensors:
            regions.append(Region(fds[t.file], t.offset, t.nbytes))
        got = digest_views([r.view() for r in regions])
        attested = manifest.strong_digests or got.strong
        for t, checksum, strong, want in zip(
            manifest.tensors, got.checksums, got.strong, attested, strict=True
        ):
            if checksum != t.checksum or strong != want:
                log.warning(
                    "set %s: tensor %r of its copy no longer has the checksum it was loaded "
                    "with; not offered to peers (engramd verify %s says more)",
                    ts.copy,
                    t.name,
                    manifest.set_id,
                )
                raise UnknownSet(
                    f"this daemon's copy of set {manifest.set_id} changed since it was loaded "
                    f"(tensor {t.name!r}); it is not offered to peers"
                )
        return got
    finally:
        close_all(regions)
        for _, fd in opened:
            os.close(fd)
