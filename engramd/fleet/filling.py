"""The sets this node is filling from peers, offered to other peers while they fill: which of
their pieces this node holds and verified.

A fill from peers (peer.py) registers its set here once its first piece
landed with the attested digest, with what the origin offered (manifest,
attestation, strong and piece digests, all checked against the fleet's key)
and the staged memory; every piece it verifies after that is marked held. The
peer port (fleet/peerservice.py) offers such a set as it offers a published one,
grants only pieces marked held, and tells its receivers as the marks grow.
What it serves is therefore only bytes that hash to the attested digests of a
set an operator published somewhere in the fleet, read-only, never the
pieces still on their way. The fill ends its entry before its staged memory
is closed; a stream that asks for a piece after that is ended.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field


def bits(held: bytes, count: int) -> int:
    """A `held` bitmap of `count` pieces as an int, bit i for piece i (empty: all of them);
    ValueError when it is not one of `count` pieces."""
    if not held:
        return (1 << count) - 1
    if len(held) != -(-count // 8) or int.from_bytes(held, "little") >> count:
        raise ValueError(f"a bitmap of {len(held)} bytes for {count} pieces")
    return int.from_bytes(held, "little")


def indices(pieces: int) -> list[int]:
    """The pieces whose bits are set, in a time that follows their number, not the set's."""
    found = []
    while pieces:
        low = pieces & -pieces
        found.append(low.bit_length() - 1)
        pieces ^= low
    return found


@dataclass
class Filling:
    """One set being filled here, as offered to peers: what its origin offered, its staged
    memory, and the pieces verified so far."""

    set_id: str
    #: The origin's manifest (layout.Manifest's JSON), forwarded as it was attested.
    manifest_json: str
    attestation: str
    strong: list[str]
    #: Each tensor's piece digests, 32 bytes each, back to back.
    piece_digests: list[bytes]
    #: Each tensor's staged memory: (fd, offset, bytes); the fds are this entry's own.
    memory: list[tuple[int, int, int]]
    #: Each piece's bytes, in the set's numbering (strong.set_pieces).
    sizes: list[int]
    #: The pieces verified here, bit i for piece i.
    _bits: int = 0
    #: Grows each time a piece is marked held: streams send their receivers the news.
    version: int = 0
    ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self, piece: int) -> None:
        """Piece `piece` landed here with its attested digest."""
        with self._lock:
            if not self._bits >> piece & 1:
                self._bits |= 1 << piece
                self.version += 1

    def holds(self, piece: int) -> bool:
        """Whether `piece` may be served."""
        with self._lock:
            return not self.ended and bool(self._bits >> piece & 1)

    def held(self) -> tuple[int, bytes]:
        """The version and the bitmap of the pieces held now."""
        with self._lock:
            return self.version, self._bits.to_bytes(-(-len(self.sizes) // 8), "little")

    def descriptors(self) -> list[tuple[int, int, int]]:
        """The staged memory with descriptors of the caller's own (to close); raises
        LookupError once the fill ended (its memory may be gone)."""
        with self._lock:
            if self.ended:
                raise LookupError(f"the fill of set {self.set_id} here ended")
            return [(os.dup(fd), offset, nbytes) for fd, offset, nbytes in self.memory]

    def end(self) -> None:
        """The fill ended: nothing more is granted, the descriptors close."""
        with self._lock:
            self.ended = True
            for fd, _, _ in self.memory:
                os.close(fd)
            self.memory = []


class FillingSets:
    """The daemon's sets in a fill from peers, by set id (one fill of a set at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[str, Filling] = {}

    def start(self, filling: Filling) -> None:
        """Offer `filling`'s held pieces to peers from now on."""
        with self._lock:
            self._sets[filling.set_id] = filling

    def get(self, set_id: str) -> Filling | None:
        """The fill of `set_id` in progress here, if one is offered."""
        with self._lock:
            return self._sets.get(set_id)

    def end(self, filling: Filling) -> None:
        """Offer it no more; its descriptors close."""
        with self._lock:
            if self._sets.get(filling.set_id) is filling:
                del self._sets[filling.set_id]
        filling.end()
