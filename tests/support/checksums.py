"""The manifest's checksum written out from its definition (engramd/checksum.py), for tests
that check what the daemon wrote."""

from __future__ import annotations

import xxhash

#: The checksum's piece: 2 MiB of the tensor from its first byte.
PIECE = 2 << 20


def checksum_by_hand(data: bytes) -> str:
    """ "xxh3-64-pieces:" and the XXH3-64 of the 8-byte XXH3-64 of each piece, back to back."""
    joined = b"".join(
        xxhash.xxh3_64(data[at : at + PIECE]).digest() for at in range(0, len(data), PIECE)
    )
    return f"xxh3-64-pieces:{xxhash.xxh3_64(joined).hexdigest()}"
