"""Tensor-parallel shards of Engram tables that stack their hash heads.

A layer's table stacks every hash head's rows: head 0's rows, then head
1's, and so on (each head's size a prime near rows / heads). Sharded by
head, a TP rank holds whole heads, so every lookup of a head is local to
one rank. `head_rows` gives the row range a rank maps, for `attach(rows=)`:

    rows = head_rows_by_table({name: head_sizes for name in tables}, rank, world)
    tables = attach("/models/ckpt", rows=rows)

Engines split heads their own way, and a rank must map exactly the rows its
engine computed: `ceil_head_rows` is vLLM's split (every shard but the last
`ceil(H / shards)` heads), `head_rows` the even one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def head_rows(head_sizes: Sequence[int], rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of the heads that TP `rank` of `world` holds, heads stacked in order.

    Whole heads, in order, as evenly as whole heads allow: with H heads each
    rank holds H // world of them and the first H % world ranks one more.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a TP group of {world}")
    if any(size <= 0 for size in head_sizes):
        raise ValueError(f"head sizes must be positive rows: {list(head_sizes)}")
    heads = len(head_sizes)
    if heads < world:
        raise ValueError(
            f"{heads} heads cannot be split into {world} TP ranks of whole heads; "
            "use a TP degree of at most the number of heads, or replicate the table"
        )
    per, extra = divmod(heads, world)
    first = rank * per + min(rank, extra)
    last = first + per + (1 if rank < extra else 0)
    return sum(head_sizes[:first]), sum(head_sizes[:last])


def ceil_head_rows(head_sizes: Sequence[int], rank: int, shards: int) -> tuple[int, int]:
    """Rows [start, stop) of shard `rank` of `shards` when heads split by ceiling division.

    vLLM's `ParallelEngramEmbedding`: each shard takes `ceil(H / shards)`
    heads in order and the last one what is left (10 heads over 4: 3, 3, 3,
    1). Like vLLM, refuses a split that leaves a shard without heads.
    """
    if not 0 <= rank < shards:
        raise ValueError(f"rank {rank} is not a shard of {shards}")
    if any(size <= 0 for size in head_sizes):
        raise ValueError(f"head sizes must be positive rows: {list(head_sizes)}")
    heads = len(head_sizes)
    per = -(-heads // shards)
    if (shards - 1) * per >= heads:
        raise ValueError(
            f"{heads} heads over {shards} shards by ceiling division ({per} each) leave "
            "the last shard without heads; use fewer shards"
        )
    first = rank * per
    return sum(head_sizes[:first]), sum(head_sizes[: first + per])


def head_rows_by_table(
    head_sizes: Mapping[str, Sequence[int]], rank: int, world: int
) -> dict[str, tuple[int, int]]:
    """`attach(rows=)` for TP `rank` of `world`: each table's rows of the rank's heads."""
    return {name: head_rows(sizes, rank, world) for name, sizes in head_sizes.items()}
