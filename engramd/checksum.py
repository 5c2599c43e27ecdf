"""The tensors' checksum in the manifest, and the buffered read loop it runs over.

A tensor's checksum is "xxh3-64-pieces:<16 hex digits>": the XXH3-64 of
its pieces' XXH3-64 digests (8 bytes each, as `xxh3_64.digest()` writes
them) back to back, a piece being BUFFER_BYTES of the tensor from its first
byte (the last one shorter; an empty tensor has none). Each piece is
digested on its own, so a load digests the pieces of one tensor on every
copy thread at once, each while its bytes are still in that core's cache,
where one streaming digest of the whole tensor held the copy threads to one
core's XXH3 (~12 GB/s here). Any reader that goes in order (verify, a
worker's proof, a GPU copy read back) gets the same value from `Digest`,
whatever sizes it reads in.

XXH3 (~12 GB/s a core here) replaced zlib's CRC32 (4 GB/s), which took a
fifth of a load's CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import xxhash

#: The checksum this engramd writes ("xxh3-64-pieces:<16 hex digits>").
CHECKSUM = "xxh3-64-pieces"
# Small enough to stay in a core's L2 cache between the read and the
# checksum, large enough that per-call overhead vanishes (~5 us per 2 MiB).
# Also the checksum's piece: changing it changes every checksum.
BUFFER_BYTES = 2 << 20

Bytes = bytes | bytearray | memoryview


def piece_digest(piece: Bytes) -> bytes:
    """The 8-byte XXH3-64 of one piece."""
    return xxhash.xxh3_64_digest(piece)


def combined(piece_digests: Sequence[bytes]) -> str:
    """The manifest's checksum of a tensor from its pieces' digests, in order."""
    return f"{CHECKSUM}:{xxhash.xxh3_64_hexdigest(b''.join(piece_digests))}"


class Digest:
    """A tensor's checksum from its bytes fed in order, in pieces of any size."""

    def __init__(self) -> None:
        self._piece = xxhash.xxh3_64()
        self._filled = 0
        self._digests: list[bytes] = []

    def update(self, data: Bytes) -> None:
        """Feed the tensor's next bytes."""
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), BUFFER_BYTES - self._filled)
            self._piece.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == BUFFER_BYTES:
                self._end_piece()

    def label(self) -> str:
        """The checksum as the manifest writes it, of every byte fed so far."""
        last = [self._piece.digest()] if self._filled else []
        return combined(self._digests + last)

    def _end_piece(self) -> None:
        self._digests.append(self._piece.digest())
        self._piece.reset()
        self._filled = 0


def chunks(fd: int, offset: int, nbytes: int) -> Iterator[memoryview]:
    """`nbytes` of `fd` from `offset`, in BUFFER_BYTES pieces of one reused buffer.

    Raises EOFError when the file ends first.
    """
    buffer = memoryview(bytearray(BUFFER_BYTES))
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [buffer[: nbytes - done]], offset + done)
        if n == 0:
            raise EOFError(f"ended {nbytes - done} bytes early")
        yield buffer[:n]
        done += n


def digest_fd(fd: int, offset: int, nbytes: int) -> str:
    """The checksum of `nbytes` of `fd` from `offset` ("short" if the file is shorter)."""
    digest = Digest()
    try:
        for chunk in chunks(fd, offset, nbytes):
            digest.update(chunk)
    except EOFError:
        return "short"
    return digest.label()
