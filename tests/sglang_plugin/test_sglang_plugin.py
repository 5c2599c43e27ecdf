"""engramd's SGLang plugin against the real SGLang 0.5.23, on CPU.

Each test runs real SGLang ranks (tests/sglang_plugin/sglang_rank.py): SGLang's
own `load_plugins()` loads the plugin through its entry point and applies its
hooks with SGLang's HookRegistry, a real gloo TP GroupCoordinator and SGLang's
Engram layers are built over a DeepSeek-V4.1-shaped checkpoint, and
DeepseekV4ForCausalLM's own load_weights loads it through SGLang's default
safetensors iterator. Only the calls that need a GPU are replaced (see
`cpu_only` there).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_harness import (
    InBucket,
    across_a_generation,
    from_private_to_the_daemon,
    on_the_daemons_pages,
    one_generation_left,
    readahead,
    result,
)
from sglang_plugin.sglang_harness import Model, make_model, run_ranks

WARNING = "engramd does not serve the Engram tables here"


def _may_cache(model: Model) -> int:
    """Table bytes that may be in the page cache after a rank's load: the tables'
    fingerprint samples (8 x 4 KiB a file, engramd's), and one readahead window (and a
    page) at each of a file's two table boundaries beside the tensors the rank reads."""
    files = list(model.folder.glob("*.safetensors"))
    return len(files) * (8 * 4096 + 2 * (max(readahead(model.folder), 4096) + 4096))


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def test_entry_point_is_engramds_and_imports_no_engine() -> None:
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert {p.name: p.value for p in points}["engramd"] == "engramd_client.engines.sglang:register"
    code = "import sys, engramd_client.engines.sglang; print('sglang' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _spans(ranks: list[dict[str, Any]], layer: str) -> list[tuple[int, int]]:
    return [(o["layers"][layer]["start"], o["layers"][layer]["end"]) for o in ranks]


def test_tp4_per_rank_ranks_hold_sglangs_rows_of_the_daemons_copy(
    model: Model, served: Any, tmp_path: Path
) -> None:
    from sglang.srt.layers.engram import EngramLayout, shard_range
    from sglang_plugin.sglang_harness import LAYER_IDS, engram_config

    layout = EngramLayout.from_config(engram_config(model.rows))
    assert layout is not None
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    runs = run_ranks(model, 4, env, tmp_path)
    ranks = [result(d) for d in runs]
    for rank, out in enumerate(ranks):
        assert out["patched"] and out["iterator_patched"]
        for index, layer_id in enumerate(LAYER_IDS):
            info = out["layers"][str(layer_id)]
            # SGLang's own rows for the rank (6 columns over 4 ranks: its even-row split).
            start, end = shard_range(model.rows[index], layout.column_bounds(index), rank, 4)
            assert (info["start"], info["end"]) == (start, end)
            assert info["shape"] == [end - start, 256]
            assert info["served"] and info["host_table"] == "ServedTable", info
            assert info["weight_dtype"] == "torch.float8_e4m3fn"
            assert info["scale_dtype"] == "torch.float8_e8m0fnu"
            # Byte for byte the checkpoint's rows, in the daemon's read-only shared pages.
            assert info["same_bytes"] == [True, True]
            for key in ("weight_map", "scale_map"):
                assert str(served.shm_dir) in info[key], (info[key], runs[rank].stderr[-3000:])
                assert info[key].split()[1] == "r--s", info[key]
            assert info["anonymous_kib"] == 0  # no private copy, after loading
            # Without a GPU the lookup's addresses are the host views' own.
            assert info["pointers_are_tensors"]
        # Loading read the other weights, none of the tables: the process read far less
        # than the tables, and the tables' pages stayed out of the page cache (mincore,
        # which tells the checkpoint's reads from the interpreter's own).
        assert out["read_bytes"] < model.table_bytes / 2, out["read_bytes"]
        assert out["table_bytes_cached"] <= _may_cache(model), out["table_bytes_cached"]
        assert "Some weights are not initialized" not in str(out)
    for index, layer_id in enumerate(LAYER_IDS):
        spans = _spans(ranks, str(layer_id))
        assert spans[0][0] == 0 and spans[-1][1] == model.rows[index]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # One copy for the four ranks.
    assert len(served.status().sets) == 1


def test_shared_layout_maps_the_whole_table(model: Model, served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    runs = run_ranks(model, 2, env, tmp_path, ("--layout", "shared"))
    for done in runs:
        out = result(done)
        for index, info in enumerate(out["layers"].values()):
            assert info["served"] and info["shape"] == [model.rows[index], 256]
            assert info["same_bytes"] == [True, True]
            assert str(served.shm_dir) in info["weight_map"]
            assert info["anonymous_kib"] == 0
        assert out["read_bytes"] < model.table_bytes / 2, out["read_bytes"]
        assert out["table_bytes_cached"] <= _may_cache(model), out["table_bytes_cached"]
        assert "Some weights are not initialized" not in _output(done)


def test_daemon_down_serves_engramds_private_copy_with_one_warning(
    model: Model, tmp_path: Path
) -> None:
    """No daemon at the socket: engramd's own private live copy of the rank's rows serves
    (SGLang's host tables are never allocated, the checkpoint's tables never loaded by it),
    one warning naming the socket."""
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock")}
    (done,) = run_ranks(model, 1, env, tmp_path)
    out = result(done)
    assert out["patched"]
    for info in out["layers"].values():
        assert info["served"] and info["same_bytes"] == [True, True], info
        assert "/memfd:engramd-private" in info["weight_map"], info["weight_map"]
        assert info["pointers_are_tensors"]
    log = _output(done)
    assert log.count("Falling back to private tables") == 1, log[-3000:]
    assert str(tmp_path / "none.sock") in log


def test_ranks_built_while_the_daemon_is_down_move_to_its_copy(
    model: Model, daemons: Any, sock_dir: Path, tmp_path: Path
) -> None:
    """Two TP ranks built while the daemon is down serve engramd's private live copy; once the
    daemon is ready they move to its copy at the same step (a vote on SGLang's TP group)
    within the issue's 2 s: the pointers SGLang's kernels take unchanged, the checkpoint's
    rows, the daemon's read-only pages, the private copies gone."""
    env = {"ENGRAMD_SOCKET": str(sock_dir / "d.sock")}
    d, outs = from_private_to_the_daemon(
        daemons,
        model.folder,
        lambda extra: run_ranks(model, 2, env, tmp_path, extra),
        tmp_path,
        "SGLang",
    )
    for out in outs:
        for info in out["layers"].values():
            assert info["served"] and info["same_bytes"] == [True, True], info
            assert info["pointers_are_tensors"], info
            on_the_daemons_pages(info, d.shm_dir)


def test_a_new_generation_reaches_both_ranks_at_one_step(
    model: Model, served: Any, tmp_path: Path
) -> None:
    """Two TP ranks on the daemon's copy; the operator loads the tables' next revision
    (another folder, --replaces): both move to it at the same step (a vote on SGLang's TP
    group), the pointers SGLang's kernels take unchanged, the new revision's rows, the
    daemon's read-only pages; the old generation is dropped once both moved."""
    new = make_model(tmp_path / "revision", seed=1).folder
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    ready, outs = across_a_generation(
        served, new, lambda extra: run_ranks(model, 2, env, tmp_path, extra), tmp_path, "SGLang"
    )
    for out in outs:
        for info in out["layers"].values():
            assert info["served"] and info["same_bytes"] == [True, True], info
            assert info["pointers_are_tensors"], info
            on_the_daemons_pages(info, served.shm_dir)
    one_generation_left(served, ready.set_id)


def test_sglangs_weight_updates_of_a_served_table_are_refused(
    model: Model, served: Any, tmp_path: Path
) -> None:
    """SGLang's update_weights_from_disk, _ipc, _tensor and _distributed on a rank serving
    its tables answer (False, why) as SGLang's own refusals do, naming `engramd load`,
    nothing written; an update of other weights reaches SGLang's own code."""
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    (out,) = [result(r) for r in run_ranks(model, 1, env, tmp_path, ("--updates",))]
    said = out["updates"]
    for call in (
        "update_weights_from_disk",
        "update_weights_from_ipc",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
    ):
        assert said[call].startswith("(False, \"SGLang's " + call), said
        assert "nothing was written" in said[call] and "`engramd load" in said[call], said
    assert "SGLang's" not in said["other"], said
    for info in out["layers"].values():
        assert info["served"] and info["same_bytes"] == [True, True], info


def test_strict_with_daemon_down_fails_start_up(model: Model, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock"), "ENGRAMD_SHARE": "on"}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--no-load",))
    assert done.returncode != 0
    assert "DaemonUnavailable" in done.stderr, done.stderr[-3000:]


def test_share_off_stands_aside(model: Model, served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket), "ENGRAMD_SHARE": "off"}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--no-load",))
    out = result(done)
    assert not out["patched"] and not out["iterator_patched"]
    assert not any(info["served"] for info in out["layers"].values())
    assert _output(done).count("ENGRAMD_SHARE=off: engramd's SGLang plugin stands aside") == 1
    assert len(served.status().sets[0].leases) == 0


def test_device_tables_are_left_alone(model: Model, served: Any, tmp_path: Path) -> None:
    # Without SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE SGLang keeps the tables in GPU
    # memory (here CPU parameters): the plugin registers nothing.
    env = {"ENGRAMD_SOCKET": str(served.socket), "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "0"}
    (done,) = run_ranks(model, 1, env, tmp_path)
    out = result(done)
    assert not out["patched"] and not out["iterator_patched"]
    for info in out["layers"].values():
        assert not info["served"] and info["host_table"] == "NoneType"
        assert info["same_bytes"] == [True, True]  # SGLang's loader filled its own tables
    log = _output(done)
    assert "sglang.engramd" not in log and "Applied 1 hook" not in log, log[-3000:]


def test_unknown_sglang_version_registers_nothing(
    model: Model, served: Any, tmp_path: Path
) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--no-load", "--version", "0.5.24"))
    out = result(done)
    assert not out["patched"] and not out["iterator_patched"]
    assert not any(info["served"] for info in out["layers"].values())
    assert _output(done).count("knows SGLang 0.5.23, not 0.5.24") == 1


def test_a_changed_seam_registers_nothing() -> None:
    # SGLang's HookRegistry only logs a target it cannot patch: the plugin checks first.
    import sglang.srt.layers.engram as engram
    import sglang.srt.plugins.hook_registry as registry
    from sglang.srt.environ import envs
    from sglang.srt.model_loader import weight_utils

    from engramd_client.engines.common import UnknownEngine
    from engramd_client.engines.sglang.guard import check_seams

    check_seams(engram, weight_utils, registry, envs)
    original = engram.EngramEmbedding._load_rows

    def renamed(self: Any, param: Any, weight: Any) -> None:
        return None

    try:
        engram.EngramEmbedding._load_rows = renamed
        try:
            check_seams(engram, weight_utils, registry, envs)
        except UnknownEngine as e:
            assert "EngramEmbedding methods" in str(e)
        else:
            raise AssertionError("a changed _load_rows went unnoticed")
    finally:
        engram.EngramEmbedding._load_rows = original


def test_dummy_load_format_stands_aside(model: Model, served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(served.socket)}
    (done,) = run_ranks(model, 1, env, tmp_path, ("--no-load", "--load-format", "dummy"))
    out = result(done)
    assert not any(info["served"] for info in out["layers"].values())
    assert _output(done).count("--load-format dummy: engramd's SGLang plugin stands aside") == 1


def test_a_tp_group_follows_its_leaders_answer(model: Model, served: Any, tmp_path: Path) -> None:
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


def test_an_s3_model_streamed_by_runai_maps_the_daemons_copy(
    model: Model, stored: InBucket, tmp_path: Path
) -> None:
    """SGLang's model path is s3://tables/m under runai_streamer (the real runai streamer
    reads the bucket) and the daemon loaded the set from that URL with no files of it: both
    TP ranks hold their rows of the daemon's copy, read-only and shared, byte for byte the
    checkpoint's; the tables the stream read whole are withheld from the layers."""
    extra = ("--load-format", "runai_streamer", "--reference", str(model.folder))
    runs = run_ranks(model, 2, stored.env, tmp_path, extra, path=stored.url)
    for done in runs:
        out = result(done)
        for info in out["layers"].values():
            assert info["served"] and info["host_table"] == "ServedTable", info
            assert info["same_bytes"] == [True, True]
            assert str(stored.daemon.shm_dir) in info["weight_map"], info["weight_map"]
            assert info["weight_map"].split()[1] == "r--s", info["weight_map"]
            assert info["anonymous_kib"] == 0
        assert "runai_streamer streams whole checkpoint files" in _output(done)
        assert "Some weights are not initialized" not in _output(done)
    (s,) = stored.daemon.status().sets
    assert (s.checkpoint, s.source) == (stored.url, stored.url)
