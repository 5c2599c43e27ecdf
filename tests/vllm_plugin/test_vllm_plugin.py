"""engramd's vLLM plugin against the real vLLM 0.33.0, on CPU.

Each test runs real vLLM ranks (tests/vllm_plugin/vllm_rank.py): vLLM's own
`load_general_plugins()` loads the plugin through its entry point, a real
gloo TP group and vLLM's Engram layers are built over a DeepSeek-V4.1-shaped
checkpoint, and vLLM's DefaultModelLoader loads it with weight tracking on.
Only the calls that need a GPU are replaced (see `cpu_only` there).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_harness import (
    across_a_generation,
    from_private_to_the_daemon,
    on_the_daemons_pages,
    one_generation_left,
    readahead,
    result,
)
from vllm_plugin.vllm_harness import Model, Stored, revision, run_ranks

from engramd_client.sharding import ceil_head_rows


def _table_bytes(model: Model) -> int:
    return model.spec.table_bytes


def _may_read(model: Model) -> int:
    """What a rank may read while loading: every tensor but the tables, the tables'
    fingerprint samples (8 x 4 KiB a file), and one readahead window around each
    touch (two a file: its header and the tensors beside the tables)."""
    files = list(model.folder.glob("*.safetensors"))
    other = sum(p.stat().st_size for p in files) - _table_bytes(model)
    return other + len(files) * (8 * 4096 + 2 * max(readahead(model.folder), 4096))


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def test_entry_point_is_engramds_and_imports_no_engine() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {p.name: p.value for p in points}["engramd"] == "engramd_client.engines.vllm:register"
    # The plugin module itself imports vLLM only when vLLM calls it.
    code = "import sys, engramd_client.engines.vllm; print('vllm' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_ceil_head_rows_splits_heads_as_vllm() -> None:
    heads = [11, 13, 17, 19, 23, 29, 31, 37, 41, 43]
    spans = [ceil_head_rows(heads, rank, 4) for rank in range(4)]
    # 10 heads over 4 shards: 3, 3, 3, 1.
    assert spans == [(0, 41), (41, 112), (112, 221), (221, 264)]
    assert ceil_head_rows(heads, 0, 1) == (0, sum(heads))


def test_tp4_ranks_hold_vllms_rows_of_the_daemons_copy(
    model: Model, served: Any, tmp_path: Path
) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    ranks = [result(d) for d in run_ranks(model, 4, env, tmp_path)]
    layers = model.spec.engram_layers
    for rank, out in enumerate(ranks):
        assert out["patched"] and out["model_sees_patch"]
        for index, layer_id in enumerate(layers):
            info = out["layers"][str(layer_id)]
            # vLLM's own rows for the rank, equal to engramd's vLLM split.
            assert (info["start"], info["end"]) == ceil_head_rows(model.heads[index], rank, 4)
            assert info["shards"] == 4 and info["heads"] == 3
            assert info["served"], info
            assert info["weight_dtype"] == "torch.float8_e4m3fn"
            assert info["scale_dtype"] == "torch.uint8"
            # Byte for byte the checkpoint's rows, in the daemon's mapping.
            assert info["same_bytes"] == [True, True]
            assert str(served.shm_dir) in info["weight_map"], info["weight_map"]
            assert str(served.shm_dir) in info["scale_map"], info["scale_map"]
            # Shared, read-only file pages, and none copied into the rank (after loading).
            assert info["weight_map"].split()[1] == "r--s", info["weight_map"]
            assert info["anonymous_kib"] == 0
        # Loading read the other weights, none of the tables (fingerprint samples aside).
        assert out["read_bytes"] <= _may_read(model) < _table_bytes(model) / 2, out["read_bytes"]
    # Heads 3/3/3/1: the last rank holds one head, and together the ranks hold every row.
    for index, layer_id in enumerate(layers):
        spans = [
            (o["layers"][str(layer_id)]["start"], o["layers"][str(layer_id)]["end"]) for o in ranks
        ]
        assert spans[0][0] == 0 and spans[-1][1] == sum(model.heads[index])
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert [o["layers"][str(layer_id)]["head_start"] for o in ranks] == [0, 3, 6, 9]
    status = served.status()
    assert len(status.sets) == 1


def test_daemon_down_serves_engramds_private_copy_with_one_warning(
    model: Model, tmp_path: Path
) -> None:
    """No daemon at the socket: engramd's own private live copy of vLLM's rows serves (vLLM's
    pinned tables are never allocated), vLLM's loader skips the tables, one warning naming
    the socket."""
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock")}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--private-pin",))
    out = result(done)
    assert out["patched"]
    for info in out["layers"].values():
        assert info["served"] and info["same_bytes"] == [True, True], info
        assert "/memfd:engramd-private" in info["weight_map"], info["weight_map"]
    # The copy was read while the layers were built; the loader read no table.
    assert out["read_bytes"] <= _may_read(model), out["read_bytes"]
    log = _output(done)
    assert log.count("Falling back to private tables") == 1, log[-3000:]
    assert str(tmp_path / "none.sock") in log


def test_share_off_stands_aside(model: Model, served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket), "ENGRAMD_SHARE": "off"}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--private-pin", "--no-load"))
    out = result(done)
    assert not out["patched"]
    assert not any(info["served"] for info in out["layers"].values())
    assert _output(done).count("ENGRAMD_SHARE=off: engramd's vLLM plugin stands aside") == 1
    assert len(served.status().sets[0].leases) == 0


def test_strict_with_daemon_down_fails_start_up(model: Model, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock"), "ENGRAMD_SHARE": "on"}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--no-load",))
    assert done.returncode != 0
    assert "DaemonUnavailable" in done.stderr, done.stderr[-3000:]
    assert str(tmp_path / "none.sock") in done.stderr


def test_unknown_vllm_version_disables_the_plugin(
    model: Model, served: Any, tmp_path: Path
) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    (done,) = run_ranks(
        model, 1, env, tmp_path, ("--private-pin", "--no-load", "--version", "0.34.0")
    )
    out = result(done)
    assert not out["patched"]
    assert not any(info["served"] for info in out["layers"].values())
    log = _output(done)
    assert log.count("knows vLLM 0.33.0, not 0.34.0") == 1, log[-3000:]


def test_dummy_load_format_stands_aside(model: Model, served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    extra = ("--private-pin", "--no-load", "--load-format", "dummy")
    (done,) = run_ranks(model, 1, env, tmp_path, extra)
    out = result(done)
    assert out["patched"]
    assert not any(info["served"] for info in out["layers"].values())
    assert _output(done).count("--load-format dummy: engramd's vLLM plugin stands aside") == 1


def test_a_group_follows_its_leaders_answer(model: Model, served: Any, tmp_path: Path) -> None:
    # Rank 1 sees no daemon, rank 0 does: both serve (rank 1 would have fallen back alone).
    nowhere = f"ENGRAMD_SOCKET={tmp_path / 'none.sock'}"
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    ranks = run_ranks(model, 2, env, tmp_path, ("--decide-only", "--follower-env", nowhere))
    assert [result(d)["serve"] for d in ranks] == [True, True]
    # The leader sees no daemon, rank 1 does: both serve (engramd's private live copy where
    # the daemon cannot be reached, which moves to its copy when it is back).
    (tmp_path / "again").mkdir()
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock")}
    there = f"ENGRAMD_SOCKET={served.socket}"
    ranks = run_ranks(model, 2, env, tmp_path / "again", ("--decide-only", "--follower-env", there))
    assert [result(d)["serve"] for d in ranks] == [True, True]


def test_ranks_built_while_the_daemon_is_down_move_to_its_copy(
    model: Model, daemons: Any, sock_dir: Path, tmp_path: Path
) -> None:
    """Two TP ranks built while the daemon is down serve engramd's private live copy of
    vLLM's rows; once the daemon is ready, they move to its copy at the same step (vLLM's
    Worker.execute_dummy_batch, the plugin's hook first), within the issue's 2 s: the layers'
    tables at the same addresses, the checkpoint's rows, the daemon's read-only pages, the
    private copies gone."""
    env = {"ENGRAMD_SOCKET": str(sock_dir / "d.sock")}
    d, outs = from_private_to_the_daemon(
        daemons,
        model.folder,
        lambda extra: run_ranks(model, 2, env, tmp_path, extra),
        tmp_path,
        "vLLM",
    )
    for rank, out in enumerate(outs):
        # Both tables of each layer were private.
        assert out["live"]["private_copies_before"] == 2 * len(model.spec.engram_layers)
        for index, layer_id in enumerate(model.spec.engram_layers):
            info = out["layers"][str(layer_id)]
            assert (info["start"], info["end"]) == ceil_head_rows(model.heads[index], rank, 2)
            assert info["served"] and info["same_bytes"] == [True, True], info
            on_the_daemons_pages(info, d.shm_dir)


def test_a_new_generation_reaches_both_ranks_at_one_step(
    model: Model, served: Any, tmp_path: Path
) -> None:
    """Two TP ranks on the daemon's copy; the operator loads the tables' next revision
    (another folder, --replaces): both ranks move to it at the same step (vLLM's
    Worker.execute_dummy_batch, the plugin's hook first), the layers' tables at the same
    addresses, the new revision's rows, the daemon's read-only pages; the old generation
    is dropped once both moved."""
    new = revision(model, tmp_path / "revision")
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    ready, outs = across_a_generation(
        served, new, lambda extra: run_ranks(model, 2, env, tmp_path, extra), tmp_path, "vLLM"
    )
    for out in outs:
        for layer_id in model.spec.engram_layers:
            info = out["layers"][str(layer_id)]
            assert info["same_bytes"] == [True, True], info
            on_the_daemons_pages(info, served.shm_dir)
    # Both ranks' processes ended: the old generation has no lease left.
    one_generation_left(served, ready.set_id)


def test_vllms_weight_updates_of_a_served_table_are_refused(
    model: Model, served: Any, tmp_path: Path
) -> None:
    """vLLM's Worker.reload_weights and update_weights of a served table are refused with
    the way to load a new revision, before anything is written; an update of other weights
    reaches vLLM's own code."""
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    (out,) = [result(r) for r in run_ranks(model, 1, env, tmp_path, ("--updates",))]
    said = out["updates"]
    for call in ("reload_weights", "update_weights served", "update_weights unnamed"):
        assert said[call].startswith("ServedTableUpdate: vLLM's"), said
        assert "nothing was written" in said[call] and "`engramd load" in said[call], said
    assert "layers.1.engram.embed" in said["update_weights served"], said
    assert said["update_weights other"].startswith("RuntimeError: Weight transfer not"), said
    for info in out["layers"].values():
        assert info["served"] and info["same_bytes"] == [True, True], info


def test_an_s3_model_streamed_by_runai_maps_the_daemons_copy(
    model: Model, stored: Stored, tmp_path: Path
) -> None:
    """vLLM's model is s3://tables/m under runai_streamer (its config files pulled from the
    bucket, its weights streamed by the real runai streamer) and the daemon loaded the set
    from that URL with no files of it: both TP ranks hold their rows of the daemon's copy,
    read-only and shared, byte for byte the checkpoint's; the tables the stream read are
    dropped, never copied into a rank."""
    assert stored.model.folder != model.folder
    assert not list(stored.model.folder.glob("*.safetensors"))
    extra = ("--reference", str(model.folder))
    done = run_ranks(stored.model, 2, stored.bucket.env, tmp_path, extra)
    for rank, out in enumerate(result(d) for d in done):
        for index, layer_id in enumerate(model.spec.engram_layers):
            info = out["layers"][str(layer_id)]
            assert (info["start"], info["end"]) == ceil_head_rows(model.heads[index], rank, 2)
            assert info["served"], info
            assert info["same_bytes"] == [True, True]
            assert str(stored.bucket.daemon.shm_dir) in info["weight_map"], info["weight_map"]
            assert info["weight_map"].split()[1] == "r--s", info["weight_map"]
            assert info["anonymous_kib"] == 0
        # The stream read the tables whole (runai reads whole files); the layers kept engramd's.
        assert "this load format read a table engramd serves" in _output(done[rank])
    (s,) = stored.bucket.daemon.status().sets
    assert (s.checkpoint, s.source) == (stored.bucket.url, stored.bucket.url)
