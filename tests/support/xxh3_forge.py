"""Bytes that keep a tensor's XXH3 checksum (engramd.checksum) but say what an attacker wants.

XXH3-64 over more than 240 bytes, with its public default secret, runs 8
lanes of 64-bit accumulators over 64-byte stripes, 16 stripes to a 1 KiB
block, and scrambles them only between blocks. Within a block, the word of
lane i in stripe s adds itself to acc[i ^ 1] and lo32(w ^ k) * hi32(w ^ k) to
acc[i], k being the secret's word at 8 * (s + i). So one word may be set to
anything and four others of the same lane and block restore both sums: two
whose products make up the difference, two whose products are zero (one
half of w ^ k nought) and whose values make up the sum. The block digests
the same, so the piece, the tensor's checksum and its set's do too.
"""

from __future__ import annotations

import os
import struct

import xxhash

#: XXH3's default secret (xxhash.h's XXH3_kSecret), 192 bytes.
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
BLOCK = 1024
PIECE = 2 << 20
MASK = (1 << 64) - 1
#: Stripes of a block the forgery uses: the word set, two products, two sums.
STRIPES = (3, 5, 7, 9, 11)


def _product(word: int, key: int) -> int:
    y = word ^ key
    return (y & 0xFFFFFFFF) * (y >> 32)


def forge_block(block: bytearray, lane: int, word: bytes) -> None:
    """Set lane `lane`'s word of stripe STRIPES[0] of a 1 KiB block to `word` (8 bytes),
    keeping what the block adds to both of its lane's accumulators."""
    assert len(block) == BLOCK and len(word) == 8 and 0 <= lane < 8
    at = [64 * s + 8 * lane for s in STRIPES]
    keys = [struct.unpack_from("<Q", SECRET, 8 * (s + lane))[0] for s in STRIPES]
    old = [struct.unpack_from("<Q", block, a)[0] for a in at]
    total = sum(old) & MASK
    products = sum(_product(w, k) for w, k in zip(old, keys, strict=True)) & MASK
    new = int.from_bytes(word, "little")
    # Two words whose products sum to what the new word's product leaves.
    need = (products - _product(new, keys[0])) & MASK
    b = 0xFFFFFFFF
    a, e = divmod(need, b)
    assert a <= 0xFFFFFFFF, "no split of this difference: forge another block"
    w1 = ((b << 32) | a) ^ keys[1]
    w2 = ((1 << 32) | e) ^ keys[2]
    # Two words with a nought half (product 0) whose values make up the sum.
    k3, k4 = keys[3], keys[4]
    rest = (total - new - w1 - w2 - (k3 & ~0xFFFFFFFF) - (k4 & 0xFFFFFFFF)) & MASK
    w3 = (k3 & ~0xFFFFFFFF & MASK) | (rest & 0xFFFFFFFF)
    w4 = (rest & ~0xFFFFFFFF & MASK) | (k4 & 0xFFFFFFFF)
    for a_, w in zip(at, (new, w1, w2, w3, w4), strict=True):
        struct.pack_into("<Q", block, a_, w)


def forge(path: str | os.PathLike[str], tensor_offset: int, piece: int, word: bytes) -> int:
    """Write `word` into a block in the middle of the `piece`-th 2 MiB piece of the tensor
    whose data starts at `tensor_offset` in the file at `path`, keeping that piece's XXH3-64;
    the offset in the file where `word` now is."""
    start = tensor_offset + piece * PIECE
    at = start + (PIECE // BLOCK // 2) * BLOCK
    fd = os.open(path, os.O_RDWR)
    try:
        before = xxhash.xxh3_64_digest(os.pread(fd, PIECE, start))
        for lane in range(8):
            block = bytearray(os.pread(fd, BLOCK, at))
            try:
                forge_block(block, lane, word)
            except AssertionError:
                continue
            os.pwrite(fd, bytes(block), at)
            break
        else:
            raise AssertionError("no lane of the block could be forged")
        after = xxhash.xxh3_64_digest(os.pread(fd, PIECE, start))
    finally:
        os.close(fd)
    assert after == before, "the forgery changed the piece's XXH3"
    return at + 64 * STRIPES[0] + 8 * lane
