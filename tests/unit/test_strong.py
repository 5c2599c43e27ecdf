"""A tensor's strong digest (engramd/strong.py): BLAKE3 of each 16 MiB piece, BLAKE3
over the pieces' digests; from memory on threads and from files in one pass with the
manifest's checksum."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from blake3 import blake3
from checksums import checksum_by_hand

from engramd.strong import (
    PIECE_BYTES,
    digest_files,
    digest_views,
    is_strong,
    piece_digest,
    piece_hasher,
    pieces,
    tensor_digest,
)

P = PIECE_BYTES


def by_hand(data: bytes, cuts: list[int]) -> str:
    """The strong digest of `data` cut at `cuts`, written out."""
    bounds = [0, *cuts, len(data)]
    joined = b"".join(blake3(data[a:b]).digest() for a, b in itertools.pairwise(bounds))
    return "blake3-pieces:" + blake3(joined).hexdigest()


@pytest.fixture(scope="module")
def tensor() -> bytes:
    """Two full pieces and one byte: three pieces, the last one byte long."""
    return os.urandom(2 * P + 1)


def test_the_pieces_are_16_mib_and_the_last_is_shorter() -> None:
    assert P == 16 << 20
    assert pieces(0) == []
    assert pieces(1) == [(0, 1)]
    assert pieces(P) == [(0, P)]
    assert pieces(P + 1) == [(0, P), (P, 1)]
    assert pieces(2 * P + 1) == [(0, P), (P, P), (2 * P, 1)]


def test_the_digest_is_over_the_pieces_digests_cut_at_each_64_mib(tensor: bytes) -> None:
    got = digest_views([memoryview(tensor)]).strong[0]
    assert got == by_hand(tensor, [P, 2 * P])
    assert is_strong(got)
    # The cuts are part of it: elsewhere, or none, gives another digest.
    assert got != by_hand(tensor, [P - 1, 2 * P])
    assert got != by_hand(tensor, [])
    # One piece exactly: one digest of the whole.
    one = tensor[:P]
    assert digest_views([memoryview(one)]).strong[0] == by_hand(one, [])


def test_an_empty_tensor_has_the_digest_of_no_pieces() -> None:
    empty = digest_views([memoryview(b"")])
    assert empty.strong == [tensor_digest([])] == ["blake3-pieces:" + blake3().hexdigest()]
    assert empty.checksums == [checksum_by_hand(b"")]
    # Distinct from a tensor of one empty piece, and from one of a single zero byte.
    assert empty.strong[0] != tensor_digest([blake3(b"").digest()])
    assert empty.strong[0] != digest_views([memoryview(b"\0")]).strong[0]


@pytest.mark.parametrize("at", [0, P - 1, P, 2 * P - 1, 2 * P])
def test_one_changed_byte_in_any_piece_changes_the_digest(tensor: bytes, at: int) -> None:
    base = digest_views([memoryview(tensor)]).strong[0]
    changed = bytearray(tensor)
    changed[at] ^= 0x01
    assert digest_views([memoryview(changed)]).strong[0] != base


def test_every_tensor_gets_both_digests_in_order(tensor: bytes) -> None:
    views = [memoryview(tensor), memoryview(b"abc"), memoryview(tensor[:P])]
    both = digest_views(views)
    assert both.checksums == [checksum_by_hand(bytes(v)) for v in views]
    assert both.strong == [
        by_hand(tensor, [P, 2 * P]),
        by_hand(b"abc", []),
        by_hand(tensor[:P], []),
    ]


def test_files_give_the_digests_of_their_spans_back_to_back(tmp_path: Path, tensor: bytes) -> None:
    """Row shards in two files, the first piece's end inside the second shard; a piece
    boundary is where the tensor's bytes say, not where a file ends."""
    first, second = tmp_path / "one", tmp_path / "two"
    cut = P // 2 + 3
    first.write_bytes(b"h" * 8 + tensor[:cut] + b"tail")
    second.write_bytes(b"x" * 100 + tensor[cut:])
    spans = [(first, 8, cut), (second, 100, len(tensor) - cut)]
    checksum, strong = digest_files(spans)
    assert checksum == checksum_by_hand(tensor)
    assert strong == by_hand(tensor, [P, 2 * P])
    assert digest_files([(first, 8, 0)]) == (
        checksum_by_hand(b""),
        tensor_digest([]),
    )


def test_a_file_shorter_than_its_span_is_named(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"y" * 100)
    with pytest.raises(ValueError, match="short is shorter than its header says"):
        digest_files([(short, 50, 60)])


def test_a_piece_given_in_parts_has_the_digest_of_the_whole(tensor: bytes) -> None:
    """A fill digests each window a MiB at a time as it writes it (landing.MOVE_CHUNK): the
    parts, of any sizes, give the digest of the whole piece."""
    piece = memoryview(tensor)[:P]
    for cuts in ([], [1 << 20, 2 << 20], [1, P - 1], list(range(3 << 20, P, 5 << 20))):
        hasher = piece_hasher()
        for a, b in itertools.pairwise([0, *cuts, P]):
            hasher.update(piece[a:b])
        assert hasher.digest() == piece_digest(piece)
    assert piece_digest(piece) == blake3(piece).digest()
