"""Sizes as the flags take them and as messages print them (engramd.units)."""

from __future__ import annotations

import pytest

from engramd.units import gib, parse_size


def test_sizes() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("200G") == 200 << 30
    assert parse_size("1.5TiB") == 3 << 39
    assert parse_size(" 64 MiB ") == 64 << 20
    with pytest.raises(ValueError, match="examples: 200G"):
        parse_size("lots")
    assert gib(512) == "512 B" and gib(3 << 29) == "1.50 GiB" and gib(2 << 20) == "2.00 MiB"
