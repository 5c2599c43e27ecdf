"""The pieces a filling node holds, as the peer protocol carries them (fleet/filling.py)."""

from __future__ import annotations

import pytest

from engramd.fleet.filling import bits, indices


def test_a_bitmap_names_its_pieces_and_empty_names_all() -> None:
    held = bytes([0b0000_0101, 0b1000_0000])  # pieces 0, 2 and 15 of 16
    assert indices(bits(held, 16)) == [0, 2, 15]
    assert indices(bits(b"", 10)) == list(range(10))
    assert bits(b"", 0) == 0


def test_a_bitmap_of_another_size_or_past_the_last_piece_is_refused() -> None:
    with pytest.raises(ValueError, match="a bitmap of 1 bytes for 9 pieces"):
        bits(b"\x01", 9)
    with pytest.raises(ValueError, match="for 3 pieces"):
        bits(bytes([0b0000_1000]), 3)  # piece 3 of 3
