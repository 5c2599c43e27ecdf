"""engramd's vLLM plugin serving Qwen4Exp's PLE n-gram tables, against the real vLLM 0.33.0.

Each test runs real vLLM ranks (tests/vllm_plugin/vllm_ple_rank.py): vLLM's
plugin loader, a gloo TP group, vLLM's own Qwen4ExpNGramEmbedding layers
(pinned-host tables, every embedding method) and its DefaultModelLoader
with weight tracking, over Qwen4Exp-shaped checkpoints whose row shards do
not fall on the ranks' vocab ranges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import (
    across_a_generation,
    from_private_to_the_daemon,
    one_generation_left,
    readahead,
    result,
)
from vllm_plugin.vllm_harness import (
    PLE_DTYPES,
    PleModel,
    bucket_config,
    ple_revision,
    run_ple_ranks,
)

from engramd.testing.synth import expected_ple_rows


def _layer(module: str) -> int:
    return int(module.split(".")[2])


def _expected_sha(
    model: PleModel, layer: int, part: str, start: int, rows: int, seed: int = 0
) -> str:
    """sha256 of a rank's table: the checkpoint's rows from `start` (`seed`: of the revision
    synthesized with that seed), padding rows zero."""
    spec = dataclasses.replace(model.spec, seed=seed)
    held = max(0, min(start + rows, spec.rows_of(layer)) - start)
    data = expected_ple_rows(spec, layer, part, torch.arange(start, start + held))
    width = spec.widths()[part][1]
    padded = torch.cat([data, torch.zeros(rows - held, width, dtype=torch.uint8)])
    return hashlib.sha256(padded.numpy().tobytes()).hexdigest()


def _may_read(model: PleModel) -> int:
    """What a rank may read while loading: every tensor but the PLE shards, the shards'
    fingerprint samples (8 x 4 KiB a file), and a readahead window around each touch."""
    files = list(model.folder.glob("*.safetensors"))
    other = sum(p.stat().st_size for p in files) - model.table_bytes
    return other + len(files) * (8 * 4096 + 2 * max(readahead(model.folder), 4096))


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


@pytest.mark.parametrize("fmt", list(PLE_DTYPES))
def test_tp_ranks_hold_vllms_vocab_ranges_of_the_daemons_copy(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path, fmt: str
) -> None:
    model = ple_models[fmt]
    d = daemons("--checkpoint", str(model.folder))
    runs = run_ple_ranks(model, 2, {"ENGRAMD_SOCKET": str(d.socket)}, tmp_path)
    parts = list(model.spec.widths())
    for rank, done in enumerate(runs):
        out = result(done)
        assert out["patched"]
        assert len(out["layers"]) == len(model.spec.layers)
        for module, info in out["layers"].items():
            layer = _layer(module)
            rows = model.spec.rows_of(layer)
            # vLLM's own split of the padded vocabulary over the ETP group.
            assert info["etp"] == [rank, 2]
            assert (info["start"], info["rows"]) == (rank * rows // 2, rows // 2)
            assert info["served"] == parts and list(info["maps"]) == parts
            for part in parts:
                # A read-only mapping of the daemon's copy, across shard boundaries.
                assert info["maps"][part].split()[1] == "r--s", info["maps"][part]
                assert str(d.shm_dir) in info["maps"][part]
                assert info["sha256"][part] == _expected_sha(
                    model, layer, part, info["start"], info["rows"]
                ), (rank, module, part)
            assert info["anonymous_kib"] == 0
            if fmt == "F8_E4M3":
                # The global scale stays vLLM's, loaded from the checkpoint.
                assert info["global_scale"] != torch.finfo(torch.float32).min
        # No PLE shard was read by vLLM's loader.
        assert out["read_bytes"] <= _may_read(model), out["read_bytes"]
    (served,) = d.status().sets
    assert served.family == "ple"


def test_embedding_across_dp_splits_over_every_rank(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    # Two DP replicas of TP 2: vLLM's ETP group is all 4 ranks, a quarter of the table each.
    model = ple_models["NVFP4"]
    d = daemons("--checkpoint", str(model.folder))
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    runs = run_ple_ranks(model, 4, env, tmp_path, ("--dp", "2", "--no-load"))
    for rank, done in enumerate(runs):
        for module, info in result(done)["layers"].items():
            layer = _layer(module)
            rows = model.spec.rows_of(layer)
            assert info["etp"] == [rank, 4]
            assert (info["start"], info["rows"]) == (rank * rows // 4, rows // 4)
            for part in model.spec.widths():
                assert info["sha256"][part] == _expected_sha(
                    model, layer, part, info["start"], info["rows"]
                ), (rank, module, part)


def test_a_multithreaded_load_leaves_the_served_rows_alone(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    """vLLM's multi-threaded loader (`enable_multithread_load`) honours no skip and reads the
    shards whole: the plugin withholds them from the layers, whose rows stay the daemon's
    read-only pages (a copy into them would fault)."""
    model = ple_models["BF16"]
    d = daemons("--checkpoint", str(model.folder))
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    runs = run_ple_ranks(model, 2, env, tmp_path, ("--multithread",))
    for rank, done in enumerate(runs):
        out = result(done)
        for module, info in out["layers"].items():
            assert info["maps"]["weight"].split()[1] == "r--s", info["maps"]["weight"]
            assert info["sha256"]["weight"] == _expected_sha(
                model, _layer(module), "weight", info["start"], info["rows"]
            ), (rank, module)
        assert "this load format read a table engramd serves" in _output(done)


def test_two_tp1_servers_map_one_file(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    model = ple_models["BF16"]
    d = daemons("--checkpoint", str(model.folder))
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    inodes = []
    for server in ("a", "b"):
        (tmp_path / server).mkdir()
        (done,) = run_ple_ranks(model, 1, env, tmp_path / server, ("--no-load",))
        info = next(iter(result(done)["layers"].values()))
        inodes.append(info["maps"]["weight"].split()[4])
    assert inodes[0] == inodes[1]


def test_without_a_daemon_engramds_private_copy_serves_with_one_warning(
    ple_models: dict[str, PleModel], tmp_path: Path
) -> None:
    """No daemon at the socket: engramd's own private live copy of the rank's rows serves
    (vLLM's pinned tables are never allocated), one warning naming the socket."""
    model = ple_models["F8_E4M3"]
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock")}
    (done,) = run_ple_ranks(model, 1, env, tmp_path, ("--private-pin",))
    out = result(done)
    log = _output(done)
    assert log.count("Falling back to private tables") == 1, log[-3000:]
    assert str(tmp_path / "none.sock") in log
    for module, info in out["layers"].items():
        assert info["served"] == ["weight"]
        assert "/memfd:engramd-private" in info["maps"]["weight"], info["maps"]
        assert info["sha256"]["weight"] == _expected_sha(
            model, _layer(module), "weight", 0, info["rows"]
        )


def test_ranks_built_while_the_daemon_is_down_move_to_its_copy(
    ple_models: dict[str, PleModel], daemons: Any, sock_dir: Path, tmp_path: Path
) -> None:
    """Two ETP ranks built while the daemon is down serve engramd's private live copy of
    their vocab ranges (padding rows zero); once the daemon is ready they move to its copy at
    the same step (vLLM's Worker.execute_dummy_batch, the plugin's hook first) within the
    issue's 2 s: same addresses (the UVA view is the table), the checkpoint's rows, the
    daemon's read-only pages, the private copies gone."""
    model = ple_models["BF16"]
    env = {"ENGRAMD_SOCKET": str(sock_dir / "d.sock")}
    d, outs = from_private_to_the_daemon(
        daemons,
        model.folder,
        lambda extra: run_ple_ranks(model, 2, env, tmp_path, extra),
        tmp_path,
        "vLLM",
    )
    for out in outs:
        for module, info in out["layers"].items():
            assert info["served"] == ["weight"] and info["uva_is_table"], info
            assert str(d.shm_dir) in info["maps"]["weight"], info["maps"]
            assert info["sha256"]["weight"] == _expected_sha(
                model, _layer(module), "weight", info["start"], info["rows"]
            )


@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
def test_a_new_generation_reaches_both_ranks_at_one_step(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path, fmt: str
) -> None:
    """Two ETP ranks on the daemon's copy of the PLE tables (NVFP4: its block scales a second
    table); the operator loads their next revision (another folder, --replaces): both ranks
    move every table to it at the same step (vLLM's Worker.execute_dummy_batch, the plugin's
    hook first), at the same addresses (the UVA view is the table), the new revision's rows
    with padding zero, the daemon's read-only pages; the old generation is dropped once both
    moved."""
    model = ple_models[fmt]
    d = daemons("--checkpoint", str(model.folder))
    new = ple_revision(model, tmp_path / "revision")
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    ready, outs = across_a_generation(
        d,
        new,
        lambda extra: run_ple_ranks(model, 2, env, tmp_path, extra),
        tmp_path,
        "vLLM",
        reference=False,
    )
    parts = list(model.spec.widths())
    for out in outs:
        assert len(out["layers"]) == len(model.spec.layers)
        for module, info in out["layers"].items():
            assert info["served"] == parts and info["uva_is_table"], info
            for part in parts:
                assert info["maps"][part].split()[1] == "r--s", info["maps"]
                assert str(d.shm_dir) in info["maps"][part], info["maps"]
                assert info["sha256"][part] == _expected_sha(
                    model, _layer(module), part, info["start"], info["rows"], seed=1
                ), (module, part)
                # The revision's rows differ from the first generation's.
                assert info["sha256"][part] != _expected_sha(
                    model, _layer(module), part, info["start"], info["rows"]
                ), (module, part)
    # Both ranks' processes ended: the old generation has no lease left.
    one_generation_left(d, ready.set_id)


def test_share_off_stands_aside(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    model = ple_models["BF16"]
    d = daemons("--checkpoint", str(model.folder))
    env = {"ENGRAMD_SOCKET": str(d.socket), "ENGRAMD_SHARE": "off"}
    (done,) = run_ple_ranks(model, 1, env, tmp_path, ("--private-pin",))
    out = result(done)
    assert not out["patched"]
    assert all(info["served"] == [] for info in out["layers"].values())
    assert d.status().sets[0].lease_count == 0


def test_an_s3_model_streamed_by_runai_maps_the_daemons_copy(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's model is s3://tables/m under runai_streamer and the daemon loaded its PLE tables
    from that URL with no files of them: each TP rank's vocab range of every table (NVFP4's
    block scales too) is a read-only view of the daemon's copy, the checkpoint's rows byte for
    byte across shard boundaries; the shards the stream read are withheld from the layers."""
    model = ple_models["NVFP4"]
    with bucket_config(model.folder, daemons, tmp_path, monkeypatch) as (pulled, pickled, bucket):
        assert not list(pulled.glob("*.safetensors"))
        runs = run_ple_ranks(PleModel(pulled, pickled, model.spec), 2, bucket.env, tmp_path)
        parts = list(model.spec.widths())
        for rank, done in enumerate(runs):
            out = result(done)
            assert len(out["layers"]) == len(model.spec.layers)
            for module, info in out["layers"].items():
                layer = _layer(module)
                rows = model.spec.rows_of(layer)
                assert (info["start"], info["rows"]) == (rank * rows // 2, rows // 2)
                assert info["served"] == parts
                for part in parts:
                    assert info["maps"][part].split()[1] == "r--s", info["maps"][part]
                    assert str(bucket.daemon.shm_dir) in info["maps"][part]
                    assert info["sha256"][part] == _expected_sha(
                        model, layer, part, info["start"], info["rows"]
                    ), (rank, module, part)
                assert info["anonymous_kib"] == 0
            assert "this load format read a table engramd serves" in _output(done)
        (s,) = bucket.daemon.status().sets
        assert (s.checkpoint, s.source, s.family) == (bucket.url, bucket.url, "ple")
