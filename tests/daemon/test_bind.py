"""bind(): a set's tensors in a module's place, every kind of mismatch, unbinding; TP by head."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engramd_client import (
    BindError,
    attach,
    bind,
    head_rows,
    head_rows_by_table,
    layer_names,
    plan_tables,
)

NAMES = layer_names(
    {
        "layers.{L}.engram.weight": "layers.{L}.engram.embed.weight",
        "layers.{L}.engram.scale": "layers.{L}.engram.embed.scale",
    }
)


class Engram(nn.Module):
    """A table as engines hold it: the weight a parameter, the scales a buffer, on meta."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device="meta"), False)
        scale = torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device="meta")
        self.register_buffer("scale", scale)
        self.proj = nn.Linear(4, 4)


class Layer(nn.Module):
    def __init__(self, engram: Engram) -> None:
        super().__init__()
        self.engram = engram


class Model(nn.Module):
    def __init__(self, shapes: dict[int, tuple[int, int]], **kwargs: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(n): Layer(Engram(rows, dim, **kwargs)) for n, (rows, dim) in shapes.items()}
        )


def shapes_of(checkpoint: Path) -> dict[int, tuple[int, int]]:
    return {
        int(t.name.split(".")[1]): (t.shape[0], t.shape[1])
        for t in plan_tables(checkpoint).tensors
        if t.name.endswith(".weight")
    }


def on_meta(model: nn.Module) -> list[str]:
    """The names of the model's tensors still on the meta device."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return sorted(name for name, t in tensors if t.is_meta)


def test_bind_puts_the_tables_in_place_without_a_copy(checkpoint: Path) -> None:
    model = Model(shapes_of(checkpoint))
    keys = list(model.state_dict())
    with attach(checkpoint, share=False) as tables:
        bound = bind(model, tables, NAMES)
        assert bound == {
            f"layers.{n}.engram.{part}": f"layers.{n}.engram.embed.{part}"
            for n in shapes_of(checkpoint)
            for part in ("weight", "scale")
        }
        assert on_meta(model) == []
        for name, tensor in bound.items():
            layer, _, part = name.rpartition(".")
            mine = getattr(model.get_submodule(layer), part)
            assert mine.data_ptr() == tables[tensor].data_ptr(), "the same memory, no copy"
            assert not mine.requires_grad
        assert isinstance(model.get_parameter("layers.1.engram.weight"), nn.Parameter)
        assert list(model.state_dict()) == keys, "parameters stay parameters, buffers buffers"
    # Closing the tables puts the module's own (meta) tensors back.
    assert on_meta(model) == sorted(bound)


@pytest.mark.parametrize(
    ("names", "shapes", "dtype", "message"),
    [
        (
            {"layers.1.engram.weights": "layers.1.engram.embed.weight"},
            None,
            None,
            "layers.1.engram.weights -> layers.1.engram.embed.weight: the module has no "
            "parameter or buffer layers.1.engram.weights",
        ),
        (
            {"layers.1.engram.weight": "layers.2.engram.embed.weight"},
            None,
            None,
            "layers.1.engram.weight -> layers.2.engram.embed.weight: the tables hold no "
            "tensor layers.2.engram.embed.weight",
        ),
        (NAMES, {1: (10, 256), 3: (40_000, 256)}, None, "layers.1.engram.weight is [10, 256]"),
        (
            NAMES,
            None,
            torch.bfloat16,
            "layers.1.engram.weight is [40000, 256] bfloat16 but layers.1.engram.embed.weight "
            "is [40000, 256] float8_e4m3fn",
        ),
        (lambda name: None, None, None, "the names matched none of the module's"),
    ],
    ids=["unknown-parameter", "unknown-tensor", "shape", "dtype", "nothing-matched"],
)
def test_a_mismatch_names_both_sides_and_changes_nothing(
    checkpoint: Path,
    names: Any,
    shapes: dict[int, tuple[int, int]] | None,
    dtype: torch.dtype | None,
    message: str,
) -> None:
    model = Model(shapes or shapes_of(checkpoint), **({"dtype": dtype} if dtype else {}))
    before = on_meta(model)
    with attach(checkpoint, share=False) as tables:
        with pytest.raises(BindError) as raised:
            bind(model, tables, names)
        assert message in str(raised.value)
        assert on_meta(model) == before, "a refused bind changes nothing"


def test_one_bad_pair_keeps_the_good_ones_unbound(checkpoint: Path) -> None:
    model = Model(shapes_of(checkpoint))
    with attach(checkpoint, share=False) as tables:
        with pytest.raises(BindError, match=r"hold no tensor layers\.5\.engram\.embed\.weight"):
            bind(
                model,
                tables,
                {
                    "layers.1.engram.weight": "layers.1.engram.embed.weight",
                    "layers.3.engram.weight": "layers.5.engram.embed.weight",
                },
            )
        assert "layers.1.engram.weight" in on_meta(model)


def test_refreshed_tables_keep_their_binding_when_the_old_ones_close(checkpoint: Path) -> None:
    model = Model(shapes_of(checkpoint))
    old = attach(checkpoint, share=False)
    bind(model, old, NAMES)
    new = attach(checkpoint, share=False)
    bind(model, new, NAMES)
    old.close()
    weight = new["layers.1.engram.embed.weight"]
    assert model.get_parameter("layers.1.engram.weight").data_ptr() == weight.data_ptr()
    new.close()
    assert on_meta(model) == on_meta(Model(shapes_of(checkpoint)))


def test_cuda_views_are_bound_only_from_tables_on_a_device(checkpoint: Path) -> None:
    model = Model(shapes_of(checkpoint))
    tables = attach(checkpoint, share=False)
    with tables, pytest.raises(BindError, match="cuda=True needs tables attached with device="):
        bind(model, tables, NAMES, cuda=True)
    assert "layers.1.engram.weight" in on_meta(model)


def test_layer_templates_need_the_layer_on_both_sides() -> None:
    with pytest.raises(ValueError, match=r"both templates need the layer as \{L\}"):
        layer_names({"model.engram.weight": "layers.{L}.engram.embed.weight"})
    names = layer_names({"model.layers.{L}.e.weight": "layers.{L}.engram.embed.weight"})
    assert names("model.layers.12.e.weight") == "layers.12.engram.embed.weight"
    assert names("model.layers.12.e.weight.extra") is None
    assert names("model.layers.x.e.weight") is None


def reference_split(head_sizes: list[int], world: int) -> list[tuple[int, int]]:
    """Each rank's rows, head by head: deal whole heads to ranks in order, one more to the
    first ranks when they do not divide."""
    heads_of_rank = [len(head_sizes) // world] * world
    for rank in range(len(head_sizes) % world):
        heads_of_rank[rank] += 1
    ranges, row, head = [], 0, 0
    for count in heads_of_rank:
        start = row
        for _ in range(count):
            row += head_sizes[head]
            head += 1
        ranges.append((start, row))
    return ranges


def test_head_shards_match_a_reference_split() -> None:
    rng = random.Random(7)
    for heads in range(1, 17):
        sizes = [rng.randrange(1, 1000) for _ in range(heads)]
        for world in range(1, heads + 1):
            split = [head_rows(sizes, rank, world) for rank in range(world)]
            assert split == reference_split(sizes, world), (sizes, world)
            assert split[0][0] == 0 and split[-1][1] == sum(sizes)
    with pytest.raises(ValueError, match="3 heads cannot be split into 4 TP ranks"):
        head_rows([5, 5, 5], 0, 4)
    with pytest.raises(ValueError, match="rank 2 is not a rank of a TP group of 2"):
        head_rows([5, 5], 2, 2)


def test_a_tp_rank_maps_exactly_its_heads(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    plan = plan_tables(checkpoint)
    # 8 heads over each table's rows: seven of rows // 8, the last the rest.
    sizes = {}
    for t in plan.tensors:
        block = t.shape[0] // 8
        sizes[t.name] = [block] * 7 + [t.shape[0] - 7 * block]
    with attach(checkpoint, share=False) as whole:
        for rank in range(3):
            rows = head_rows_by_table(sizes, rank, 3)
            with attach(checkpoint, socket=str(d.socket), share=True, rows=rows) as shard:
                assert shard.mode == "shared"
                for name, (start, stop) in rows.items():
                    assert torch.equal(
                        shard[name].view(torch.uint8), whole[name][start:stop].view(torch.uint8)
                    )
