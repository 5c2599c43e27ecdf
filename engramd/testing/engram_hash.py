"""The Engram lookup: hash each position's n-grams to table rows, gather the rows.

Per layer, an n-gram ending at position t hashes as the XOR of its tokens,
each multiplied by a per-layer odd multiplier; each head takes that value
modulo its own prime and adds its row offset, so the heads partition the
table. Orders 2 and 3 get half of the heads each. This is the access pattern
the tables serve at every decoding step: T x heads scattered rows per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

ORDERS = (2, 3)


def _primes_below(n: int, count: int) -> list[int]:
    found: list[int] = []
    candidate = n - 1
    while len(found) < count and candidate > 1:
        if all(candidate % d for d in range(2, int(candidate**0.5) + 1)):
            found.append(candidate)
        candidate -= 1
    if len(found) < count:
        raise ValueError(f"fewer than {count} primes below {n}; use a larger table")
    return found


@dataclass(frozen=True)
class EngramHash:
    """Row indices of a layer's Engram lookups."""

    rows: int
    layer: int
    heads: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heads % len(ORDERS) or self.rows < 4 * self.heads:
            raise ValueError(f"{self.heads} heads over {self.rows} rows do not partition")

    @property
    def rows_per_head(self) -> int:
        """Rows of the table that each head owns."""
        return self.rows // self.heads

    @cached_property
    def _parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer)
        multipliers = torch.randint(1, 1 << 30, (max(ORDERS),), generator=g) * 2 + 1
        primes = torch.tensor(_primes_below(self.rows_per_head + 1, self.heads))
        offsets = torch.arange(self.heads) * self.rows_per_head
        return multipliers, primes, offsets

    def rows_for(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row indices [T, heads] for the last T positions of `tokens` (int64, T + 2 long)."""
        multipliers, primes, offsets = self._parameters
        span = max(ORDERS) - 1
        t = tokens.numel() - span
        per_order = self.heads // len(ORDERS)
        out = torch.empty(t, self.heads, dtype=torch.int64)
        for k, order in enumerate(ORDERS):
            x = torch.zeros(t, dtype=torch.int64)
            for i in range(order):
                x ^= tokens[span - i : span - i + t] * multipliers[i]
            heads = slice(k * per_order, (k + 1) * per_order)
            out[:, heads] = torch.remainder(x[:, None], primes[heads]) + offsets[heads]
        return out


def byte_rows(table: torch.Tensor) -> torch.Tensor:
    """`table` viewed as uint8 [rows, row bytes], the operand of `gather`.

    Gathering bytes sends every dtype, float8 included, through one kernel.
    Take the view once per table: taking it in every gather (three view calls)
    cost 2.6 us per call here, more than the 1.9 us index_select of a T = 1 step.
    """
    return table.view(torch.uint8).view(table.shape[0], -1)


def gather(rows_of_bytes: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy rows_of_bytes[rows] into the preallocated `out` ([rows.numel(), row bytes]).

    `rows_of_bytes` comes from `byte_rows`; allocating `out` per call would
    halve the throughput.
    """
    return torch.index_select(rows_of_bytes, 0, rows, out=out)
