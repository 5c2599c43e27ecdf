"""engramd's SGLang plugin serving Qwen4Exp's PLE n-gram tables, against the real SGLang
0.5.23 on CPU.

Each test runs real SGLang ranks (tests/sglang_plugin/ple_rank.py): SGLang's own
`load_plugins()` loads the plugin, which patches SGLang's qwen4_exp module when it is
imported; a real gloo TP GroupCoordinator and SGLang's Qwen4ExpNGramEmbedding (with
`--ple-offload-embedding`: its Qwen4ExpPinnedHostEmbedding) are built over a
Qwen4Exp-shaped checkpoint, and Qwen4ExpForConditionalGeneration's own load_weights
loads it through SGLang's default safetensors iterator. Only the pinning of SGLang's
own host tables (which needs a CUDA runtime) is replaced.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path
from typing import Any

import pytest
from engine_harness import (
    across_a_generation,
    from_private_to_the_daemon,
    in_bucket,
    one_generation_left,
    readahead,
    result,
)
from sglang_plugin.ple_harness import (
    DTYPES,
    FP8_SCALE,
    PLE_LAYER_IDS,
    SPLIT_NGRAM_PARTS,
    Model,
    make_model,
    run_ple_ranks,
    run_servers,
)

WARNING = "engramd does not serve the PLE n-gram tables here"
LAYERS = [str(layer_id - 1) for layer_id in PLE_LAYER_IDS]


@pytest.fixture
def ple_served(ple_model: Model, daemons: Any) -> Any:
    """A daemon serving the checkpoint (loaded at start; its family chosen by the daemon)."""
    return daemons("--checkpoint", str(ple_model.folder))


def _may_cache(model: Model) -> int:
    """PLE shard bytes that may be in the page cache after a rank's load: the tables'
    fingerprint samples (8 x 4 KiB a file, engramd's), and one readahead window (and a
    page) at each end of every ordinary tensor the rank reads beside the shards."""
    files = list(model.folder.glob("*.safetensors"))
    window = max(readahead(model.folder), 4096) + 4096
    others = len(PLE_LAYER_IDS) * (2 if model.dtype == "fp8" else 1)
    return len(files) * 8 * 4096 + 2 * others * window


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def _check_served(
    model: Model, out: dict[str, Any], shm: Path, rank: int, world: int, alone: bool = True
) -> None:
    """The rank's PLE tables: SGLang's rows, the checkpoint's bytes, the daemon's pages.

    `alone`: no other process reads the checkpoint while this rank loads (the page
    cache then tells what it read).
    """
    assert out["patched"] and out["iterator_patched"], out
    for index, layer in enumerate(LAYERS):
        info = out["layers"][layer]
        rows = model.rows[index]
        assert info["type"] == "Qwen4ExpPinnedHostEmbedding"
        assert info["org_vocab_size"] == rows
        assert info["shape"] == [info["end"] - info["start"], model.width]
        assert info["dtype"] == str(DTYPES[model.dtype])
        # Byte for byte the checkpoint's rows, in the daemon's read-only shared pages.
        assert info["same_bytes"], info
        assert str(shm) in info["map"] and info["map"].split()[1] == "r--s", info["map"]
        assert info["anonymous_kib"] == 0
        if info["end"] > rows:
            # SGLang's padding past the checkpoint's end: zeros, and not the daemon's pages.
            assert rank == world - 1
            assert info["padding_zero"]
            assert str(shm) not in info["padding_map"], info["padding_map"]
        assert info["value_proj_loaded"]
        assert info["weight_scale"] == (FP8_SCALE if model.dtype == "fp8" else 1.0)
    # SGLang's loader counted every table loaded and read none of their shards: the process
    # read far less than the tables, and their pages stayed out of the page cache (mincore).
    assert out["loaded"] == sorted(
        [f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight" for layer in LAYERS]
        + [f"model.layers.{layer}.ple.value_proj.weight" for layer in LAYERS]
        + (
            [
                f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale"
                for layer in LAYERS
            ]
            if model.dtype == "fp8"
            else []
        )
    )
    assert out["read_bytes"] < model.table_bytes / 4, out["read_bytes"]
    if alone:
        assert out["table_bytes_cached"] <= _may_cache(model), out["table_bytes_cached"]


def test_tp3_ranks_hold_sglangs_rows_of_the_daemons_copy(
    ple_model: Model, ple_served: Any, tmp_path: Path
) -> None:
    env = {"ENGRAMD_SOCKET": str(ple_served.socket)}
    runs = run_ple_ranks(ple_model, 3, env, tmp_path)
    ranks = [result(d) for d in runs]
    for rank, out in enumerate(ranks):
        _check_served(ple_model, out, ple_served.shm_dir, rank, 3)
        assert "Some weights are not initialized" not in _output(runs[rank])
    padded = []
    for index, layer in enumerate(LAYERS):
        spans = [(o["layers"][layer]["start"], o["layers"][layer]["end"]) for o in ranks]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert spans[-1][1] >= ple_model.rows[index]
        padded.append(spans[-1][1] > ple_model.rows[index])
        # The split falls inside row shards.
        size = ple_model.shard_size(index)
        assert all(start % size for start, _ in spans[1:]), (spans, size)
    # Layer 1's 4096 rows do not split in 3 x 64: SGLang padded them to 64 x 3, and the last
    # rank holds 128 rows past the checkpoint's end; layer 3's 4224 rows split evenly.
    assert padded == [True, False], padded
    # One copy for the three ranks, of the family the daemon chose from the checkpoint.
    (info,) = ple_served.status().sets
    assert info.family == "ple"
    assert info.tensors == len(PLE_LAYER_IDS)


def test_two_tp1_engines_map_one_file(ple_model: Model, ple_served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(ple_served.socket)}
    outs = [result(d) for d in run_servers(ple_model, 2, env, tmp_path)]
    for out in outs:
        # The other engine compares its tables with the checkpoint meanwhile (reading the
        # shards): each engine's own reads are its read_bytes.
        _check_served(ple_model, out, ple_served.shm_dir, 0, 1, alone=False)
    for layer in LAYERS:
        # The same file (path and inode) behind both engines' tables.
        first, second = (out["layers"][layer]["map"].split() for out in outs)
        assert first[3:] == second[3:], (first, second)
    assert len(ple_served.status().sets) == 1


def test_whole_file_reads_never_write_the_served_table(
    ple_model: Model, ple_served: Any, tmp_path: Path
) -> None:
    # disable_mmap: SGLang's own iterator reads whole files, the shards too; the rows it
    # read reach the layers as empty placeholders, so the read-only pages stay untouched.
    env = {"ENGRAMD_SOCKET": str(ple_served.socket)}
    (done,) = run_ple_ranks(ple_model, 1, env, tmp_path, ("--whole-files",))
    out = result(done)
    for layer in LAYERS:
        info = out["layers"][layer]
        assert info["same_bytes"] and info["map"].split()[1] == "r--s"
    assert "SGLang reads whole checkpoint files here" in _output(done)


def test_share_off_stands_aside(ple_model: Model, ple_served: Any, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(ple_served.socket), "ENGRAMD_SHARE": "off"}
    (done,) = run_ple_ranks(ple_model, 1, env, tmp_path)
    out = result(done)
    assert not out["patched"] and not out["iterator_patched"]
    for info in out["layers"].values():
        assert info["same_bytes"]  # SGLang's loader filled its own table
        assert str(ple_served.shm_dir) not in info["map"]
    assert out["read_bytes"] >= ple_model.table_bytes, out["read_bytes"]
    assert _output(done).count("ENGRAMD_SHARE=off: engramd's SGLang plugin stands aside") == 1
    assert len(ple_served.status().sets[0].leases) == 0


def test_daemon_down_serves_engramds_private_copy_with_one_warning(
    ple_model: Model, tmp_path: Path
) -> None:
    """No daemon at the socket: engramd's own private live copy of the rank's rows (padding
    zero) serves SGLang's pinned backend, one warning naming the socket."""
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock")}
    (done,) = run_ple_ranks(ple_model, 1, env, tmp_path)
    out = result(done)
    assert out["patched"]
    for info in out["layers"].values():
        assert info["same_bytes"] and info["padding_zero"], info
        assert "/memfd:engramd-private" in info["map"], info["map"]
    log = _output(done)
    assert log.count("Falling back to private tables") == 1, log[-3000:]
    assert str(tmp_path / "none.sock") in log


def test_ranks_built_while_the_daemon_is_down_move_to_its_copy(
    ple_model: Model, daemons: Any, sock_dir: Path, tmp_path: Path
) -> None:
    """Two TP ranks built while the daemon is down serve engramd's private live copy of their
    vocab ranges; once the daemon is ready they move to its copy at the same step within the
    issue's 2 s: same addresses, the checkpoint's rows, padding zero, the daemon's pages, the
    private copies gone."""
    env = {"ENGRAMD_SOCKET": str(sock_dir / "d.sock")}
    d, outs = from_private_to_the_daemon(
        daemons,
        ple_model.folder,
        lambda extra: run_ple_ranks(ple_model, 2, env, tmp_path, extra),
        tmp_path,
        "SGLang",
    )
    for out in outs:
        for info in out["layers"].values():
            assert info["same_bytes"] and info["padding_zero"], info
            assert str(d.shm_dir) in info["map"], info["map"]


def test_a_new_generation_reaches_both_ranks_at_one_step(
    ple_model: Model, ple_served: Any, tmp_path: Path
) -> None:
    """Two TP ranks on the daemon's copy of the PLE tables; the operator loads their next
    revision (another folder, --replaces): both move to it at the same step (a vote on
    SGLang's TP group), the table SGLang's kernels read at the same address, the new
    revision's rows with padding zero, the daemon's read-only pages; the old generation is
    dropped once both moved."""
    new = make_model(tmp_path / "revision", ple_model.dtype, seed=1).folder
    env = {"ENGRAMD_SOCKET": str(ple_served.socket)}
    ready, outs = across_a_generation(
        ple_served,
        new,
        lambda extra: run_ple_ranks(ple_model, 2, env, tmp_path, extra),
        tmp_path,
        "SGLang",
    )
    for out in outs:
        assert list(out["layers"]) == LAYERS
        for info in out["layers"].values():
            # Checked against the revision's files (--reference): its rows, not the first's.
            assert info["same_bytes"] and info["padding_zero"], info
            assert info["map"].split()[1] == "r--s", info["map"]
            assert str(ple_served.shm_dir) in info["map"], info["map"]
    # Both ranks' processes ended: the old generation has no lease left.
    one_generation_left(ple_served, ready.set_id)


def test_strict_with_daemon_down_fails_start_up(ple_model: Model, tmp_path: Path) -> None:
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock"), "ENGRAMD_SHARE": "on"}
    (done,) = run_ple_ranks(ple_model, 1, env, tmp_path, ("--no-load",))
    assert done.returncode != 0
    assert "DaemonUnavailable" in done.stderr, done.stderr[-3000:]


#: SGLang's file backend on CPU: its device check skipped by its own variable, its
#: resident-set trimmer's budget small enough that a trim has something to drop.
FILE_BACKEND_ENV = {
    "SGLANG_QWEN4_PLE_FILE_SKIP_DEVICE_CHECK": "1",
    "SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB": "0.0001",
}


@pytest.fixture
def on_disk(ple_model: Model, daemons: Any, tmp_path: Path) -> Any:
    """A daemon holding the checkpoint's PLE tables on a disk folder (--backing disk)."""
    disk = tmp_path / "tables"
    disk.mkdir()
    args = ("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(ple_model.folder))
    d = daemons(*args)
    d.disk, d.args = disk, args
    return d


def _file_ranks(
    model: Model, world: int, socket: Path, tmp: Path, tp1_engines: int = 0
) -> list[dict[str, Any]]:
    env = {"ENGRAMD_SOCKET": str(socket), **FILE_BACKEND_ENV}
    extra = ("--backend", "file", "--offload-dir", str(tmp / "sglang-ple"))
    if tp1_engines:
        return [result(d) for d in run_servers(model, tp1_engines, env, tmp, extra)]
    return [result(d) for d in run_ple_ranks(model, world, env, tmp, extra)]


def _check_file_served(model: Model, out: dict[str, Any], disk: Path, tmp: Path) -> None:
    """SGLang's file backend ran over the daemon's disk copy: it wrote no table, and its
    prefetcher and trimmer worked on the mapping."""
    for info in out["layers"].values():
        assert info["prefetcher"] == "MappedPrefetcher" and info["prefetch_queued"], info
        assert info["trimmed_bytes"] > 0 and info["same_after_trim"], info
    # No table file of SGLang's own: its folder was never made, its loader dirtied no page.
    assert not (tmp / "sglang-ple").exists()
    assert out["write_bytes"] < model.table_bytes / 100, out["write_bytes"]


def test_file_backend_tp2_maps_the_daemons_disk_copy(
    ple_model: Model, on_disk: Any, tmp_path: Path
) -> None:
    ranks = _file_ranks(ple_model, 2, on_disk.socket, tmp_path)
    for rank, out in enumerate(ranks):
        _check_served(ple_model, out, on_disk.disk, rank, 2)
        _check_file_served(ple_model, out, on_disk.disk, tmp_path)
    [s] = on_disk.status().sets
    assert s.backing == "disk" and s.lease_count == 0 and not s.locked


def test_file_backend_engines_and_a_daemon_restart_read_and_write_no_table_bytes(
    ple_model: Model, on_disk: Any, daemons: Any, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    first = _file_ranks(ple_model, 1, on_disk.socket, tmp_path / "a", tp1_engines=2)
    for out in first:
        _check_served(ple_model, out, on_disk.disk, 0, 1, alone=False)
        _check_file_served(ple_model, out, on_disk.disk, tmp_path / "a")
    for layer in LAYERS:
        # The same file (path and inode) behind both engines' tables.
        one, two = (out["layers"][layer]["map"].split() for out in first)
        assert one[3:] == two[3:], (one, two)
    on_disk.stop()
    # The next daemon takes the copy over from the disk; an engine started after it maps
    # the same file, reading and writing no table byte.
    again = daemons(*on_disk.args)
    [s] = again.status().sets
    assert s.adopted and s.backing == "disk"
    (tmp_path / "b").mkdir()
    [out] = _file_ranks(ple_model, 1, again.socket, tmp_path / "b")
    _check_served(ple_model, out, on_disk.disk, 0, 1)
    _check_file_served(ple_model, out, on_disk.disk, tmp_path / "b")
    for layer in LAYERS:
        assert (
            out["layers"][layer]["map"].split()[3:] == first[0]["layers"][layer]["map"].split()[3:]
        )


def test_file_backend_without_a_daemon_runs_sglangs_own_file_with_one_warning(
    ple_model: Model, tmp_path: Path
) -> None:
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock"), **FILE_BACKEND_ENV}
    extra = ("--backend", "file", "--offload-dir", str(tmp_path / "ple"))
    (done,) = run_ple_ranks(ple_model, 1, env, tmp_path, extra)
    out = result(done)
    for info in out["layers"].values():
        # SGLang's own sparse file, filled by its loader, prefetched by its own prefetcher.
        assert str(tmp_path / "ple") in info["map"] and info["same_bytes"]
        assert info["prefetcher"] == "PleFilePrefetcher"
    assert out["write_bytes"] >= ple_model.table_bytes, out["write_bytes"]
    log = _output(done)
    assert log.count(WARNING) == 1, log[-3000:]


def test_a_checkpoint_sglang_would_place_otherwise_is_not_served(
    ple_model: Model, daemons: Any, tmp_path: Path
) -> None:
    # The same checkpoint, told its tables were split in 5 parts: SGLang would place shard N
    # at N x ceil(rows / 5), not where the 7 shards joined back to back put it.
    import json
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(ple_model.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["split_ngram_parts"] = 5
    (folder / "config.json").write_text(json.dumps(config))
    served = daemons("--checkpoint", str(folder))
    moved = Model(folder, ple_model.dtype, ple_model.rows)
    (done,) = run_ple_ranks(
        moved, 1, {"ENGRAMD_SOCKET": str(served.socket)}, tmp_path, ("--no-load",)
    )
    out = result(done)
    for info in out["layers"].values():
        assert str(served.shm_dir) not in info["map"]
    log = _output(done)
    assert log.count(WARNING) == 1, log[-3000:]
    size, rows = ple_model.shard_size(0), ple_model.rows[0]
    shards = [size] * (SPLIT_NGRAM_PARTS - 1) + [rows - size * (SPLIT_NGRAM_PARTS - 1)]
    assert f"hold {shards} rows, and SGLang places shard N at row N x {-(-rows // 5)}" in log


def test_a_changed_seam_registers_nothing() -> None:
    import sglang.srt.layers.vocab_parallel_embedding as vocab
    import sglang.srt.models.qwen4_exp as qwen4_exp

    from engramd_client.engines.common import UnknownEngine
    from engramd_client.engines.sglang.guard import check_ple_seams

    check_ple_seams(qwen4_exp, vocab)
    original = qwen4_exp.allocate_ple_host_table

    def renamed(shape: Any, dtype: Any, backend: str = "pinned", directory: Any = None) -> None:
        return None

    try:
        qwen4_exp.allocate_ple_host_table = renamed
        with pytest.raises(UnknownEngine, match="the PLE allocator"):
            check_ple_seams(qwen4_exp, vocab)
    finally:
        qwen4_exp.allocate_ple_host_table = original


def test_an_s3_model_streamed_by_runai_maps_the_daemons_copy(
    ple_model: Model, daemons: Any, tmp_path: Path
) -> None:
    """SGLang's model path is s3://tables/m under runai_streamer and the daemon loaded the PLE
    tables from that URL with no files of them: the plugin learns each table's shape, dtype
    and shard rows from the daemon (its checks and SGLang's rows need them), and each TP
    rank's rows are the daemon's read-only pages, byte for byte the checkpoint's; the shards
    the stream read are withheld from the layers."""
    with in_bucket(ple_model.folder, daemons, tmp_path) as bucket:
        extra = ("--load-format", "runai_streamer", "--reference", str(ple_model.folder))
        runs = run_ple_ranks(ple_model, 2, bucket.env, tmp_path, extra, path=bucket.url)
        for rank, done in enumerate(runs):
            out = result(done)
            assert out["patched"], out
            for index, layer in enumerate(LAYERS):
                info = out["layers"][layer]
                assert info["org_vocab_size"] == ple_model.rows[index]
                assert info["same_bytes"], (rank, layer, info)
                assert str(bucket.daemon.shm_dir) in info["map"], info["map"]
                assert info["map"].split()[1] == "r--s", info["map"]
                assert info["anonymous_kib"] == 0
                assert info["value_proj_loaded"]
            assert "runai_streamer streams whole checkpoint files" in _output(done)
            assert WARNING not in _output(done)
        (s,) = bucket.daemon.status().sets
        assert (s.checkpoint, s.source, s.family) == (bucket.url, bucket.url, "ple")
