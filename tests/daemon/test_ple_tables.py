"""Qwen4Exp's PLE n-gram tables: row shards joined into one table, each rank's vocab range
one read-only mapping of the daemon's copy, padding rows past its end zero.

Real daemons and worker processes (tests/support/ple_probe.py) over synthetic
Qwen4Exp checkpoints (engramd.testing.synth.synthesize_ple) whose shard
boundaries do not fall on the ranks' ranges.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SUPPORT, wait_until
from engramd.testing.synth import PleSpec, SynthSpec, expected_ple_rows, synthesize, synthesize_ple
from engramd_client import attach
from engramd_shared.beneath import Root
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import CheckpointError
from engramd_shared.families import ENGRAM, PLE
from engramd_shared.headers import read_header

PROBE = SUPPORT / "ple_probe.py"
#: 1000 rows in 7 shards of 143; 4 ranks of a vocabulary padded to 1024 hold 256 each.
SPEC = PleSpec(layers=(0, 2), rows=1000, dim=64, parts=7, fmt="BF16")
PADDED = 1024


def _ranges(spec: PleSpec, world: int, padded: int) -> list[dict[str, tuple[int, int]]]:
    """Each rank's rows of every table: an even split of the padded vocabulary."""
    per = padded // world
    return [
        {
            f"{spec.table(layer)}.{part}": (r * per, (r + 1) * per)
            for layer in spec.layers
            for part in spec.widths()
        }
        for r in range(world)
    ]


def _probe(
    ckpt: Path, spec: PleSpec, rows: dict[str, tuple[int, int]], *args: str
) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            str(PROBE),
            str(ckpt),
            json.dumps(rows),
            "--spec",
            json.dumps(dataclasses.asdict(spec)),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def ple(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize_ple(tmp_path_factory.mktemp("ple") / "qwen4exp", SPEC)


def test_row_shards_are_one_table_in_shard_order(ple: Path) -> None:
    plan = plan_tables(ple)
    assert plan.selection == PLE.selection
    names = [t.name for t in plan.tensors]
    assert names == sorted(f"{SPEC.table(layer)}.weight" for layer in SPEC.layers)
    for t in plan.tensors:
        assert t.shape == (SPEC.rows, SPEC.dim) and t.dtype == "BF16"
        assert [p.name.split(".")[-2] for p in t.parts] == [f"shard_{i}" for i in range(7)]
        assert [p.shape[0] for p in t.parts] == [143] * 6 + [142]
        assert t.nbytes == sum(p.nbytes for p in t.parts) == SPEC.rows * SPEC.dim * 2
    # The global scales and every other tensor stay the engine's.
    assert plan.checkpoint_names[names[0]][0].endswith(".shard_0.weight")


def test_auto_picks_each_checkpoints_family(ple: Path, checkpoint: Path, tmp_path: Path) -> None:
    # A DeepSeek-V4.1 checkpoint keeps the set id it had under the explicit selection.
    assert plan_tables(checkpoint).set_id == plan_tables(checkpoint, ENGRAM.selection).set_id
    assert plan_tables(checkpoint).selection == ENGRAM.selection
    # Without config.json the tensor names decide.
    bare = synthesize_ple(tmp_path / "bare", dataclasses.replace(SPEC, parts=3))
    (bare / "config.json").unlink()
    assert plan_tables(bare).selection == PLE.selection
    # An architecture decides over names: a Qwen4Exp config without PLE shards selects nothing.
    both = synthesize(tmp_path / "mixed", SynthSpec(rows=64, layers=1))
    (both / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForCausalLM"]}))
    with pytest.raises(CheckpointError, match="no tensor matches"):
        plan_tables(both)


def test_a_missing_shard_or_a_mismatched_one_is_refused(tmp_path: Path) -> None:
    from engramd.testing.synth import write_safetensors

    ckpt = synthesize_ple(tmp_path / "gap", dataclasses.replace(SPEC, layers=(0,), files=1))
    header = read_header(next(ckpt.glob("*.safetensors")))
    # Rewrite the one file without shard 3.
    path = next(ckpt.glob("*.safetensors"))
    from engramd.testing.synth import _Tensor

    kept = []
    with open(path, "rb") as f:
        for name, t in header.tensors.items():
            if ".shard_3." in name:
                continue
            f.seek(t.offset)
            kept.append(_Tensor(name, t.dtype, t.shape, iter([f.read(t.nbytes)])))
    path.unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    write_safetensors(path, kept)
    with pytest.raises(CheckpointError, match="skip shard 3"):
        plan_tables(ckpt)


def test_tp_ranks_map_their_vocab_ranges_of_one_copy(
    ple: Path, daemons: Any, shm_dir: Path
) -> None:
    d = daemons("--checkpoint", str(ple))
    ranges = _ranges(SPEC, 4, PADDED)
    ranks = [_probe(ple, SPEC, rows, "--socket", str(d.socket)) for rows in ranges]
    inodes: dict[str, set[str]] = {}
    for rank, out in enumerate(ranks):
        assert out["mode"] == "shared"
        # The engine's loader skips every shard of the tables served.
        assert len(out["served"]) == 14 and all(".shard_" in n for n in out["served"])
        for name, (start, stop) in ranges[rank].items():
            info = out[name]
            assert info["shape"] == [stop - start, SPEC.dim] and info["dtype"] == "torch.bfloat16"
            assert info["same_bytes"] and info["padding_zero"], (rank, name)
            # One read-only mapping of the daemon's file, across shard boundaries.
            fields = info["map"].split()
            assert fields[1] == "r--s" and str(shm_dir) in info["map"], info["map"]
            inodes.setdefault(name, set()).add(fields[4])
    # Every rank maps the one copy of each table.
    assert all(len(found) == 1 for found in inodes.values())
    (ple_set,) = d.status().sets
    assert ple_set.family == "ple" and ple_set.tensors == 2


def test_two_tp1_servers_share_one_file_and_private_matches(
    ple: Path, daemons: Any, tmp_path: Path
) -> None:
    d = daemons("--allow-root", str(ple.parent))
    whole = _ranges(SPEC, 1, PADDED)[0]
    # Loaded by the first worker's attach, under auto: the PLE selection is accepted.
    first = _probe(ple, SPEC, whole, "--socket", str(d.socket), "--share", "on")
    second = _probe(ple, SPEC, whole, "--socket", str(d.socket), "--share", "on")
    for name in whole:
        assert first[name]["same_bytes"] and first[name]["padding_zero"]
        assert first[name]["map"].split()[4] == second[name]["map"].split()[4]
    # engramd's private fallback reads the same rows from the shards, padding zero.
    private = _probe(ple, SPEC, whole, "--share", "off")
    assert private["mode"] == "private"
    for name in whole:
        assert private[name]["same_bytes"] and private[name]["padding_zero"]
        assert " r--s " not in private[name]["map"]


def test_nvfp4_block_scales_are_a_second_table_split_like_the_weight(
    tmp_path: Path, daemons: Any
) -> None:
    spec = dataclasses.replace(SPEC, fmt="NVFP4", layers=(1,), parts=5)
    ckpt = synthesize_ple(tmp_path / "nvfp4", spec)
    d = daemons("--checkpoint", str(ckpt))
    ranges = _ranges(spec, 3, 1002)
    for rows in ranges:
        out = _probe(ckpt, spec, rows, "--socket", str(d.socket))
        for name in rows:
            assert out[name]["same_bytes"] and out[name]["padding_zero"], name
        scale = out[f"{spec.table(1)}.weight_scale"]
        assert scale["dtype"] == "torch.float8_e4m3fn" and scale["shape"][1] == 4


def test_a_range_past_the_end_needs_pad_rows(ple: Path) -> None:
    name = f"{SPEC.table(0)}.weight"
    with pytest.raises(ValueError, match="outside the tensor's 1000 rows"):
        attach(ple, tensors=PLE.selection, rows={name: (900, 1024)}, share=False)
    tables = attach(
        ple, tensors=PLE.selection, rows={name: (900, 1024)}, share=False, pad_rows=True
    )
    rows = tables[name].view(torch.uint8).reshape(124, -1)
    assert torch.equal(rows[:100], expected_ple_rows(SPEC, 0, "weight", torch.arange(900, 1000)))
    assert not rows[100:].any()
    tables.close()


def test_status_names_each_sets_family(ple: Path, checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(ple), "--checkpoint", str(checkpoint))
    wait_until(lambda: len(d.status().sets) == 2, 30, "both sets")
    assert sorted(s.family for s in d.status().sets) == ["engram", "ple"]


def test_a_workers_attach_loads_shards_of_two_files_beneath_its_root(
    tmp_path: Path, daemons: Any, shm_dir: Path
) -> None:
    spec = dataclasses.replace(SPEC, parts=3)
    root = tmp_path / "models"
    ckpt = synthesize_ple(root / "qwen4exp", spec)
    # The second file lies in another folder of the root, reached by a symlink the walk
    # follows inside it: each span is read from the file the walk held, not a name.
    second = sorted(ckpt.glob("*.safetensors"))[1]
    (root / "blobs").mkdir()
    second.rename(root / "blobs" / second.name)
    second.symlink_to(Path("..") / "blobs" / second.name)
    plan = plan_tables(ckpt, PLE.selection, Root(root))
    for t in plan.tensors:
        files = {p.file for p in t.spans}
        assert len(files) == 2, t.name
        assert all(str(f) in plan.held for f in files), (files, list(plan.held))
    d = daemons("--allow-root", str(root))
    whole = _ranges(spec, 1, PADDED)[0]
    out = _probe(ckpt, spec, whole, "--socket", str(d.socket), "--share", "on")
    assert out["mode"] == "shared"
    for name in whole:
        assert out[name]["same_bytes"] and out[name]["padding_zero"], name
        fields = out[name]["map"].split()
        assert fields[1] == "r--s" and str(shm_dir) in out[name]["map"], out[name]["map"]
    (ple_set,) = d.status().sets
    assert ple_set.family == "ple" and ple_set.tensors == 2


def test_auto_beneath_a_root_reads_no_config_outside_it(tmp_path: Path) -> None:
    root = tmp_path / "models"
    ckpt = synthesize(root / "engram", SynthSpec(rows=64, layers=1))
    outside = tmp_path / "config.json"
    outside.write_text(json.dumps({"architectures": ["Qwen4ExpForCausalLM"]}))
    (ckpt / "config.json").unlink(missing_ok=True)
    (ckpt / "config.json").symlink_to(outside)
    # The operator's own path is followed: its config names Qwen4Exp, whose tables it lacks.
    with pytest.raises(CheckpointError, match="no tensor matches"):
        plan_tables(ckpt)
    # Beneath a root, a config.json leading out of it decides nothing: the tensor names do.
    assert plan_tables(ckpt, "auto", Root(root)).selection == ENGRAM.selection
