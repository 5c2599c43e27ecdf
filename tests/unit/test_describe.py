"""What a worker learns of a checkpoint's tables before it maps a row (engramd_client.describe),
and the daemon's answers it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from engramd.testing.synth import PleSpec, SynthSpec, synthesize, synthesize_ple
from engramd_client import describe
from engramd_client.share import _table_info
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import DaemonError
from engramd_shared.pb import engramd_pb2 as pb


def test_a_folders_tables_with_their_row_shards(tmp_path: Path) -> None:
    ple = synthesize_ple(tmp_path / "ple", PleSpec())
    plan = plan_tables(ple)
    described = describe(ple)
    assert [t.name for t in described] == [t.name for t in plan.tensors]
    for info, entry in zip(described, plan.tensors, strict=True):
        assert (info.set_id, info.dtype, info.shape) == (plan.set_id, entry.dtype, entry.shape)
        assert info.parts == tuple(p.name for p in entry.parts) and len(info.parts) > 1
        assert sum(info.part_rows) == info.shape[0] and len(info.part_rows) == len(info.parts)
    # Tables of their own: no shards.
    engram = describe(synthesize(tmp_path / "engram", SynthSpec(rows=1000)))
    assert engram and all(t.parts == () == t.part_rows for t in engram)


def _handle(shape: list[int], parts: list[str], rows: list[int]) -> pb.TensorHandle:
    return pb.TensorHandle(name="t", dtype="BF16", shape=shape, parts=parts, part_rows=rows)


def test_a_daemons_shard_rows_that_do_not_add_up_are_refused() -> None:
    assert _table_info("s", _handle([4, 8], ["a", "b"], [3, 1])).part_rows == (3, 1)
    # An older daemon names the shards and not their rows.
    assert _table_info("s", _handle([4, 8], ["a", "b"], [])).part_rows == ()
    for shape, parts, rows in (
        ([4, 8], ["a", "b"], [3, 2]),
        ([4, 8], ["a"], [2, 2]),
        ([4, 8], ["a", "b"], [4, 0]),
        ([], ["a"], [4]),
    ):
        with pytest.raises(DaemonError, match="row shards of t"):
            _table_info("s", _handle(shape, parts, rows))
