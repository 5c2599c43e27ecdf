"""A small Engram layer, written the way model code holds its tables.

Per layer: the token n-grams (orders 2 and 3) ending at each position are
hashed by several heads; head h maps its hash into its own block of rows
of one table that stacks every head's rows (`head_sizes`), the table a
checkpoint stores as `layers.{L}.engram.embed.weight` (fp8 e4m3, with e8m0
scales per 32 values in `...embed.scale`). The looked-up rows of all heads
are dequantized and concatenated; a key and a value projection of them
are mixed into the hidden state through a sigmoid gate on the key's
agreement with the hidden state.

The tables are parameters made on the meta device: they take no memory
until `engramd_client.bind` puts the node's shared copy (or a private one)
in their place.
"""

from __future__ import annotations

import torch
from torch import nn

from engramd_client import TablePlan

#: n-gram orders; each takes half of the heads.
ORDERS = (2, 3)
SCALE_GROUP = 32
#: Which parameter of EngramModel each tensor of a checkpoint binds to.
TABLE_NAMES = {
    "layers.{L}.engram.weight": "layers.{L}.engram.embed.weight",
    "layers.{L}.engram.scale": "layers.{L}.engram.embed.scale",
}


def head_sizes(rows: int, heads: int) -> list[int]:
    """Rows of each head's block of a stacked table: equal blocks, the last takes the rest."""
    block = rows // heads
    return [block] * (heads - 1) + [rows - block * (heads - 1)]


class MultiHeadEmbedding(nn.Module):
    """One table stacking every head's rows, fp8 with e8m0 scales; gathers and dequantizes."""

    sizes: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, rows: int, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        sizes = torch.tensor(head_sizes(rows, heads))
        self.register_buffer("sizes", sizes, persistent=False)
        self.register_buffer("offsets", torch.cumsum(sizes, 0) - sizes, persistent=False)
        weight = torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(rows, dim // SCALE_GROUP, dtype=torch.float8_e8m0fnu, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def rows_for(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row indices [batch, T, heads] of the n-grams ending at each position of `tokens`."""
        padded = nn.functional.pad(tokens, (max(ORDERS) - 1, 0))
        per_order = self.heads // len(ORDERS)
        hashes = []
        for k, order in enumerate(ORDERS):
            x = torch.zeros_like(tokens)
            for i in range(order):
                # Odd multipliers per (order, position in the n-gram), fixed by the model.
                shifted = padded[:, max(ORDERS) - 1 - i : padded.shape[1] - i]
                x ^= shifted * (2 * (1_000_003 * (k + 1) + 7_919 * i) + 1)
            count = per_order if k < len(ORDERS) - 1 else self.heads - per_order * k
            hashes.append(x[..., None].expand(*x.shape, count))
        h = torch.cat(hashes, dim=-1)
        return torch.remainder(h, self.sizes) + self.offsets

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Dequantized rows [batch, T, heads * dim] for every head."""
        rows = self.rows_for(tokens).flatten()
        # Gather bytes: one kernel for every dtype, fp8 included.
        values = self.weight.view(torch.uint8).index_select(0, rows).view(torch.float8_e4m3fn)
        exponents = self.scale.view(torch.uint8).index_select(0, rows).float() - 127
        scales = torch.exp2(exponents).repeat_interleave(SCALE_GROUP, dim=-1)
        out = values.float() * scales
        return out.view(*tokens.shape, -1)


class EngramLayer(nn.Module):
    """Engram lookup, key and value projections, and the gate that mixes them in."""

    def __init__(self, rows: int, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.engram = MultiHeadEmbedding(rows, dim, heads)
        self.key = nn.Linear(heads * dim, hidden, bias=False)
        self.value = nn.Linear(heads * dim, hidden, bias=False)
        self.norm_hidden = nn.RMSNorm(hidden)
        self.norm_key = nn.RMSNorm(hidden)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`hidden` with the gated memory of the n-grams at each position added."""
        memory = self.engram(tokens)
        key = self.norm_key(self.key(memory))
        gate = torch.sigmoid((self.norm_hidden(hidden) * key).sum(-1, keepdim=True))
        return hidden + gate * self.value(memory)


class EngramModel(nn.Module):
    """Token embedding and an Engram layer per layer number of the checkpoint."""

    def __init__(
        self, layers: dict[int, tuple[int, int]], heads: int, hidden: int, vocab: int, seed: int
    ) -> None:
        """`layers`: {layer number: (rows, dim)} of its table. Dense weights from `seed`."""
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleDict(
                {str(n): EngramLayer(rows, dim, heads, hidden) for n, (rows, dim) in layers.items()}
            )

    @classmethod
    def for_checkpoint(
        cls, plan: TablePlan, heads: int = 8, hidden: int = 64, vocab: int = 32_000, seed: int = 0
    ) -> EngramModel:
        """A model whose Engram tables have the shapes of the checkpoint's."""
        layers = {}
        for t in plan.tensors:
            parts = t.name.split(".")
            if parts[0] == "layers" and t.name.endswith(".engram.embed.weight"):
                layers[int(parts[1])] = (t.shape[0], t.shape[1])
        return cls(layers, heads, hidden, vocab, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, T, hidden] after every Engram layer."""
        hidden = self.embed(tokens)
        for layer in self.layers.values():
            hidden = layer(hidden, tokens)
        return hidden
