"""A set's manifest (engramd_shared.layout): written, read back, and refused when malformed."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from backing_fill import sample_manifest

from engramd_shared.layout import (
    DIRECT_ALIGN,
    PACKED_ALIGN,
    Manifest,
    ManifestError,
    extents,
    lead,
    packed_tensors,
)


def test_manifest_round_trip_and_refusals() -> None:
    m = sample_manifest()
    assert Manifest.from_json(m.to_json()) == m
    legacy = json.loads(m.to_json())
    del legacy["sources"]  # written by engramd 0.1
    assert Manifest.from_json(json.dumps(legacy)).sources == ()
    joined = {**legacy, "tensors": [{**legacy["tensors"][0], "parts": ["a", "b"]}]}
    # A joined table of a set written before the shards' rows were kept: no rows to tell.
    assert Manifest.from_json(json.dumps(joined)).tensors[0].part_rows == ()
    joined["tensors"][0]["part_rows"] = [3, 1]
    assert Manifest.from_json(json.dumps(joined)).tensors[0].part_rows == (3, 1)
    for broken in (
        {**legacy, "layout_version": 99},
        {k: v for k, v in legacy.items() if k != "nonce"},
        {**legacy, "nonce": "not hex"},
        {**legacy, "tensors": [{**legacy["tensors"][0], "file": "../escape.bin"}]},
        {**legacy, "tensors": [{**legacy["tensors"][0], "dtype": "Q4"}]},
        {**legacy, "sources": [{"path": "/x"}]},
        # Row shards whose rows are not the table's 4, or not counts of rows.
        *(
            {**legacy, "tensors": [{**legacy["tensors"][0], "parts": parts, "part_rows": rows}]}
            for parts, rows in (
                (["a", "b"], [3, 2]),
                (["a"], [2, 2]),
                (["a", "b"], [5, -1]),
                (["a", "b"], [4, 0]),
                (["a"], "4"),
                (["a"], [True]),
            )
        ),
    ):
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(broken))


def test_a_tensor_keeps_its_offset_within_a_page_where_its_elements_stay_aligned() -> None:
    @dataclass(frozen=True)
    class At:
        dtype: str
        offset: int
        nbytes: int

    # Within its page as in its checkpoint; an F32 at an offset off its 4 bytes gets none.
    tensors = [At("BF16", 3 * DIRECT_ALIGN + 8, 100), At("U8", 5, 1), At("F32", 4098, 8)]
    assert [lead(t) for t in tensors] == [8, 5, 0]
    assert extents(tensors) == [108, 6, 8]
    # Packed: each in pages of its own, at its lead.
    assert packed_tensors(tensors) == ([8, PACKED_ALIGN + 5, 2 * PACKED_ALIGN], 3 * PACKED_ALIGN)
