"""A worker's mapped regions cut to a rank's rows (engramd_client.mapping)."""

from __future__ import annotations

import pytest

from engramd_client.mapping import Region


def test_region_cut_to_rows() -> None:
    r = Region("t", "BF16", (10, 4), "/f", 100, 80)
    assert r.cut(None) is r and r.cut({"other": (0, 1)}) is r
    shard = r.cut({"t": (2, 5)})
    assert (shard.shape, shard.offset, shard.length) == ((3, 4), 100 + 2 * 8, 3 * 8)
    assert r.cut({"t": (4, 4)}).length == 0
    for bad in ((-1, 2), (3, 2), (0, 11)):
        with pytest.raises(ValueError, match="outside the tensor's 10 rows"):
            r.cut({"t": bad})
