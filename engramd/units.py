"""Sizes as people write and read them."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def gib(n: int) -> str:
    """Bytes as a short human-readable size."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """Bytes from "200G", "1.5TiB", "4096"; K/M/G/T/P are powers of 1024.

    Raises ValueError naming the examples.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 200G, 1.5TiB, 4096)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** " kmgtp".index(unit.lower() or " "))
