"""The manifest's checksum (engramd.checksum): XXH3-64 of each 2 MiB piece of a tensor, and
XXH3-64 over the pieces' digests; the same from pieces digested apart as from bytes fed in
order in any sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from checksums import PIECE, checksum_by_hand

from engramd.checksum import BUFFER_BYTES, Digest, combined, digest_fd, piece_digest

SIZES = [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 5]


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(3 * PIECE + 5)


def fed(data: bytes, step: int) -> str:
    digest = Digest()
    for at in range(0, len(data), step):
        digest.update(memoryview(data)[at : at + step])
    return digest.label()


def test_the_piece_is_the_loaders_buffer() -> None:
    # The loader digests each of its pieces apart: they must be the checksum's pieces.
    assert BUFFER_BYTES == PIECE


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("step", [1 << 20, PIECE, PIECE + 4097, 7 << 20])
def test_bytes_fed_in_any_sizes_give_the_checksum_written_out(
    data: bytes, size: int, step: int
) -> None:
    assert fed(data[:size], step) == checksum_by_hand(data[:size])


@pytest.mark.parametrize("size", SIZES)
def test_pieces_digested_apart_give_the_same_checksum(data: bytes, size: int) -> None:
    part = data[:size]
    pieces = [piece_digest(part[at : at + PIECE]) for at in range(0, size, PIECE)]
    assert combined(pieces) == checksum_by_hand(part)


def test_a_label_midway_leaves_the_digest_going(data: bytes) -> None:
    digest = Digest()
    digest.update(data[: PIECE + 10])
    assert digest.label() == checksum_by_hand(data[: PIECE + 10])
    digest.update(data[PIECE + 10 :])
    assert digest.label() == checksum_by_hand(data)


def test_a_changed_byte_or_swapped_pieces_change_it(data: bytes) -> None:
    base = checksum_by_hand(data)
    changed = bytearray(data)
    changed[PIECE + 3] ^= 1
    assert fed(bytes(changed), PIECE) != base
    swapped = data[PIECE : 2 * PIECE] + data[:PIECE] + data[2 * PIECE :]
    assert fed(swapped, PIECE) != base


def test_a_file_is_digested_and_a_short_one_is_named(tmp_path: Path, data: bytes) -> None:
    f = tmp_path / "t"
    f.write_bytes(b"header" + data)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert digest_fd(fd, 6, len(data)) == checksum_by_hand(data)
        assert digest_fd(fd, 6, len(data) + 1) == "short"
    finally:
        os.close(fd)
