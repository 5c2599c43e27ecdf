"""A tensor's strong digest: BLAKE3 of each fixed piece, and BLAKE3 over the pieces' digests.

XXH3-64 (engramd.checksum) catches accidents at ~12 GB/s a core, but it
is no defence against bytes built on purpose to share a tensor's digest:
with its public secret, a second preimage of a piece is arithmetic (one
word of a 1 KiB block set at will, three of the same lane fixed up). So
every comparison that decides whose bytes a set holds uses this digest: a
held set proven against other files than its own (sets/proof.py), what a
fill publishes, and what the fleet's attestation covers (fleet/trust.py). A tensor is cut into
pieces of PIECE_BYTES (16 MiB, a fill's window; the last piece shorter, an
empty tensor none); its digest is "blake3-pieces:" and the hex BLAKE3 of
its pieces' 32-byte digests back to back. So a piece can be checked on its
own against its digest, and a list of piece digests against the one
attested tensor digest, whoever sent them; and a receiver digests each
window as it lands, on any core, in any order (landing.py).

BLAKE3, not SHA-256: a receiver digests every byte it is sent, beside the
transfer, on the same cores. One core hashes 16 MiB pieces at 2.9 GiB/s
with BLAKE3 (AVX2) against 1.5 GiB/s with SHA-256 and SHA-NI (this host's
EPYC), so a fill's digest costs half the CPU.

BLAKE3 releases the GIL while it hashes, so the pieces are hashed on a
pool of threads, one per core (os.cpu_count()).
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from blake3 import blake3

from engramd.checksum import Digest, chunks
from engramd_shared.fileid import open_regular

#: The strong digest this engramd makes, its name in manifests and offers
#: ("blake3-pieces:<64 hex digits>").
STRONG = "blake3-pieces"
#: The bytes of a piece (the last of a tensor may be shorter): small enough that a window of
#: a fill is one piece and a ring of them stays small, large enough that hashing it is all of
#: its cost.
PIECE_BYTES = 16 << 20

_STRONG = re.compile(rf"^{STRONG}:[0-9a-f]{{64}}$")


class Hasher(Protocol):
    """A hash given its bytes in order, as BLAKE3's objects are."""

    def update(self, data: memoryview | bytes, /) -> object:
        """Hash `data` after the bytes given before."""

    def digest(self) -> bytes:
        """The digest of every byte given."""


def threads() -> int:
    """Threads that hash pieces at once: one per core."""
    return os.cpu_count() or 1


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, size) of each piece of a tensor of `nbytes`."""
    return [(at, min(PIECE_BYTES, nbytes - at)) for at in range(0, nbytes, PIECE_BYTES)]


def set_pieces(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tensor, offset, size) of each piece of a set whose tensors have `sizes`: the numbering
    of pieces a fill's requests use (the proto's FillRequest.piece)."""
    return [(i, at, n) for i, nbytes in enumerate(sizes) for at, n in pieces(nbytes)]


def piece_hasher() -> Hasher:
    """A hash to give a piece's bytes in parts, in order: its digest() is piece_digest's of
    the whole piece."""
    # blake3() hashes on one thread: the pools hash several pieces at once already.
    return blake3()


def piece_digest(piece: memoryview | bytes) -> bytes:
    """The 32-byte digest of one piece."""
    hasher = piece_hasher()
    hasher.update(piece)
    return hasher.digest()


def tensor_digest(piece_digests: Sequence[bytes]) -> str:
    """The tensor's strong digest from its pieces' digests, in order."""
    return f"{STRONG}:{piece_digest(b''.join(piece_digests)).hex()}"


def split_pieces(joined: bytes, nbytes: int, strong: str) -> list[bytes]:
    """The piece digests of a tensor of `nbytes` from `joined` (32 bytes each, back to back),
    once they proved to hash to its strong digest `strong`; raises ValueError otherwise."""
    count = len(pieces(nbytes))
    if len(joined) != 32 * count:
        raise ValueError(f"{len(joined) // 32} piece digests for a tensor of {count} pieces")
    split = [joined[k : k + 32] for k in range(0, len(joined), 32)]
    if tensor_digest(split) != strong:
        raise ValueError("its piece digests do not hash to its strong digest")
    return split


def is_strong(text: str) -> bool:
    """Whether `text` is a strong digest as tensor_digest writes it."""
    return _STRONG.match(text) is not None


class StrongDigest:
    """A tensor's strong digest from its bytes fed in order, in parts of any size: what
    tensor_digest gives of its pieces' digests."""

    def __init__(self) -> None:
        self._piece = piece_hasher()
        self._filled = 0
        self._digests: list[bytes] = []

    def update(self, data: memoryview | bytes) -> None:
        """Feed the tensor's next bytes."""
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), PIECE_BYTES - self._filled)
            self._piece.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == PIECE_BYTES:
                self._digests.append(self._piece.digest())
                self._piece = piece_hasher()
                self._filled = 0

    def label(self) -> str:
        """The strong digest, as tensor_digest writes it, of every byte fed so far."""
        last = [self._piece.digest()] if self._filled else []
        return tensor_digest(self._digests + last)


def digester(like: str) -> Digest | StrongDigest:
    """A digest of the kind `like` names: a strong digest (STRONG), or else a checksum."""
    return StrongDigest() if like.partition(":")[0] == STRONG else Digest()


def digest_fd_as(fd: int, offset: int, nbytes: int, like: str) -> str:
    """The digest, of the kind `like` names (a checksum or a strong digest), of `nbytes` of
    `fd` from `offset` ("short" if the file is shorter)."""
    digest = digester(like)
    try:
        for chunk in chunks(fd, offset, nbytes):
            digest.update(chunk)
    except EOFError:
        return "short"
    return digest.label()


@dataclass(frozen=True)
class Digests:
    """Each tensor's checksum (the manifest's), strong digest and pieces' digests, in order."""

    checksums: list[str]
    strong: list[str]
    pieces: list[list[bytes]]


def _checksum(view: memoryview) -> str:
    digest = Digest()
    digest.update(view)
    return digest.label()


def digest_views(views: Sequence[memoryview]) -> Digests:
    """Each tensor's checksum and strong digest from its bytes in memory, its pieces hashed
    on threads."""
    with ThreadPoolExecutor(threads(), "engramd-digest") as pool:
        sums = [pool.submit(_checksum, v) for v in views]
        hashed = [
            [pool.submit(piece_digest, v[at : at + n]) for at, n in pieces(len(v))] for v in views
        ]
        found = [[f.result() for f in fs] for fs in hashed]
        return Digests([f.result() for f in sums], [tensor_digest(ds) for ds in found], found)


def digest_files(spans: Sequence[tuple[Path, int, int]]) -> tuple[str, str]:
    """(checksum, strong digest) of a tensor read from files: `spans` are its (file, offset,
    bytes) back to back (one, or its row shards).

    The pieces are read in order on this thread, which also takes the checksum,
    and hashed on the pool: one piece buffer a thread in flight. Raises
    ValueError when a file is shorter than its span.
    """
    width = threads()
    checksum = Digest()
    pending: deque[tuple[Future[bytes], bytearray]] = deque()
    done: list[bytes] = []
    with _Spans(spans) as reader, ThreadPoolExecutor(width, "engramd-digest") as pool:
        for _, n in pieces(sum(size for _, _, size in spans)):
            if len(pending) >= width:
                future, buffer = pending.popleft()
                done.append(future.result())
            else:
                buffer = bytearray(PIECE_BYTES)
            view = memoryview(buffer)[:n]
            reader.read_into(view)
            checksum.update(view)
            pending.append((pool.submit(piece_digest, view), buffer))
        done += [future.result() for future, _ in pending]
    return checksum.label(), tensor_digest(done)


class _Spans:
    """Reads the spans' bytes in order, wherever a piece starts and ends."""

    def __init__(self, spans: Sequence[tuple[Path, int, int]]) -> None:
        self._left = deque(spans)
        self._fd = -1

    def __enter__(self) -> _Spans:
        return self

    def __exit__(self, *_: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_into(self, view: memoryview) -> None:
        """Fill `view` with the next bytes."""
        filled = 0
        while filled < len(view):
            path, offset, size = self._left[0]
            if self._fd < 0:
                self._fd = open_regular(path)
            want = min(size, len(view) - filled)
            got = os.preadv(self._fd, [view[filled : filled + want]], offset) if want else 0
            if want and not got:
                raise ValueError(f"{path} is shorter than its header says")
            filled += got
            if got == size:
                self._left.popleft()
                self._close()
            else:
                self._left[0] = (path, offset + got, size - got)
