"""The seed's disk_offload under vLLM 0.33.0: Qwen4Exp's PLE rows read each step on the host
from the daemon's disk copy (or the checkpoint's own files), no table allocated.

Each test runs real vLLM ranks (vllm_ple_rank.py --lookup): vLLM's own
Qwen4ExpNGramEmbedding layers with their pinned-host tables on a gloo group,
looked up through vLLM's own entry points (`sync_lookup`, `start_prefetch` /
`finalize_prefetch`, with its ETP reduce), against a daemon started with
`--backing disk`.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import result
from vllm_plugin.vllm_harness import (
    PLE_DTYPES,
    PLE_RANK,
    PleModel,
    bucket_config,
    make_ple_model,
    run_ple_ranks,
)

from engramd.testing.synth import expected_ple_rows

WARNING = "engramd does not serve the PLE n-gram tables here"


def _on_disk(daemons: Any, model: PleModel, tmp: Path) -> Any:
    """A daemon keeping `model`'s PLE tables on a disk folder (--backing disk)."""
    disk = tmp / "tables"
    disk.mkdir(exist_ok=True)
    args = ("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(model.folder))
    d = daemons(*args)
    d.disk, d.args = disk, args
    return d


def _layer(module: str) -> int:
    return int(module.split(".")[2])


def _expected(model: PleModel, layer: int, ids: torch.Tensor, scale2: Any) -> torch.Tensor:
    """What a lookup of `ids` returns after the ETP reduce, as bytes [n, row bytes] (NVFP4:
    the rows decoded to bf16, as vLLM's dequantize_to_dtype decodes them)."""
    flat = ids.reshape(-1)
    weight = expected_ple_rows(model.spec, layer, "weight", flat)
    if model.spec.fmt != "NVFP4":
        return weight
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    scales = expected_ple_rows(model.spec, layer, "weight_scale", flat).view(torch.float8_e4m3fn)
    rows = dequantize_to_dtype(weight, scales, scale2, torch.bfloat16, swizzle=False)
    return rows.view(torch.uint8).reshape(flat.numel(), -1)


def _same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal rows after a reduce that sums each row's owner with zeros: bytes for fp8 (reduced
    as raw bytes), values for bf16 (a sum makes -0 +0 and may change a NaN's payload)."""
    if dtype != torch.bfloat16:
        return torch.equal(got, want)
    a, b = got.view(torch.bfloat16), want.view(torch.bfloat16)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_lookups(model: PleModel, saved: dict[str, Any], step: int = 0) -> int:
    """Every saved lookup of `step` returns the checkpoint's rows: byte for byte this rank's
    own rows and zeros for the others' (before the reduce), every row after it through both
    entry points; the number of ids checked."""
    checked = 0
    dtype = torch.float8_e4m3fn if model.spec.fmt == "F8_E4M3" else torch.bfloat16
    for key, looked in saved.items():
        module, _, which = key.rpartition("/")
        if which != str(step):
            continue
        scale2 = saved.get(f"{module}/weight_scale_2")
        for one in looked:
            ids = one["ids"]
            want = _expected(model, _layer(module), ids, scale2)
            start, stop = one["range"]
            mine = ((ids >= start) & (ids < stop)).reshape(-1, 1)
            local = one["local"].contiguous().view(torch.uint8).reshape(ids.numel(), -1)
            assert torch.equal(local * mine, want * mine), (module, model.spec.fmt)
            # Another rank's rows are zeros (NVFP4's decoded zeros take the global scale's sign).
            others = local.view(dtype) if dtype == torch.bfloat16 else local
            assert not others[~mine.reshape(-1)].any(), (module, model.spec.fmt)
            for entry in ("sync", "prefetch"):
                got = one[entry].contiguous().view(torch.uint8).reshape(ids.numel(), -1)
                assert _same(got, want, dtype), (module, entry, model.spec.fmt)
            checked += ids.numel()
    return checked


def _run(
    model: PleModel, world: int, env: dict[str, str], tmp: Path, *extra: str
) -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    """Run `world` ranks looking rows up; each rank's JSON, saved lookups and log."""
    tmp.mkdir(parents=True, exist_ok=True)
    runs = run_ple_ranks(
        model, world, env, tmp, ("--lookup", str(tmp / "looked-{rank}.pt"), *extra)
    )
    out = []
    for rank, done in enumerate(runs):
        info = result(done)
        out.append((info, torch.load(tmp / f"looked-{rank}.pt"), done.stdout + done.stderr))
    return out


@pytest.mark.parametrize("fmt", list(PLE_DTYPES))
def test_tp2_reads_the_checkpoints_rows_from_the_daemons_disk_copy(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path, fmt: str
) -> None:
    model = ple_models[fmt]
    d = _on_disk(daemons, model, tmp_path)
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    for rank, (info, saved, log) in enumerate(_run(model, 2, env, tmp_path / "tp2")):
        assert info["patched"]
        for layer in info["layers"].values():
            assert layer["etp"] == [rank, 2]
            # The layer holds a read-only view of the daemon's disk file, nothing of its own.
            for part, where in layer["maps"].items():
                assert where.split()[1] == "r--s" and str(d.disk) in where, (part, where)
            assert layer["anonymous_kib"] == 0
        assert _check_lookups(model, saved) > 0
        assert "read each step on the host from the daemon's file" in log
    (s,) = d.status().sets
    assert s.backing == "disk"


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> PleModel:
    """A bf16 Qwen4Exp checkpoint whose PLE tables (about 25 MiB each) dwarf what a rank
    allocates for a step."""
    return make_ple_model(tmp_path_factory.mktemp("large") / "BF16", "BF16", vocab_base=100_000)


def test_two_tp1_engines_read_one_file_and_allocate_no_table(
    large: PleModel, daemons: Any, tmp_path: Path
) -> None:
    d = _on_disk(daemons, large, tmp_path)
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    inodes = set()
    for engine in ("a", "b"):
        ((info, saved, _),) = _run(large, 1, env, tmp_path / engine)
        assert _check_lookups(large, saved) > 0
        tables = sum(sum(layer["nbytes"].values()) for layer in info["layers"].values())
        assert tables > 40 << 20
        # Building the layers, loading and looking rows up left no table in the engine's own
        # memory (about 4 MiB grew here, vLLM's loader's and the lookups'): a private table
        # would be all of `tables`, one layer's half of it.
        assert info["anonymous_growth_kib"] * 1024 < tables / 4, info["anonymous_growth_kib"]
        inodes |= {layer["maps"]["weight"].split()[4] for layer in info["layers"].values()}
    # Every engine's rows of a layer are the same file of the daemon's.
    assert len(inodes) == len(large.spec.layers)


def test_the_rows_come_from_the_daemons_file_not_the_checkpoints(
    large: PleModel, daemons: Any, tmp_path: Path
) -> None:
    d = _on_disk(daemons, large, tmp_path)
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    evict = ("--no-load", "--evict", str(d.disk), "--evict", str(large.folder))
    ((info, saved, _),) = _run(large, 1, env, tmp_path / "run", *evict)
    assert _check_lookups(large, saved) > 0
    # Both were out of the page cache before the step; after it, the rows the step read are
    # in the page cache from the daemon's file alone.
    assert info["cached_before"] == {str(d.disk): 0, str(large.folder): 0}, info
    assert info["cached"][str(d.disk)] > 0
    assert info["cached"][str(large.folder)] == 0, info["cached"]


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup (v1) of the test's own; removed after (its process gone back to the
    root group)."""
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "cgroup.procs").exists():
        pytest.skip("no memory cgroup (v1) hierarchy at /sys/fs/cgroup/memory")
    group = root / f"engramd-test-{os.getpid()}-{secrets.token_hex(3)}"
    group.mkdir()
    try:
        yield group
    finally:
        group.rmdir()


def test_a_rank_in_a_cgroup_holding_a_quarter_of_the_table_reads_every_row(
    large: PleModel, daemons: Any, tmp_path: Path, memory_cgroup: Path
) -> None:
    d = _on_disk(daemons, large, tmp_path)
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    extra = ("--no-load", "--all-rows", "--evict", str(d.disk), "--cgroup", str(memory_cgroup))
    ((info, saved, _),) = _run(large, 1, env, tmp_path / "run", *extra)
    module = next(iter(info["layers"]))
    rows = large.spec.rows_of(_layer(module))
    every = expected_ple_rows(large.spec, _layer(module), "weight", torch.arange(rows))
    want = hashlib.sha256(every.numpy().tobytes()).hexdigest()
    assert saved[f"{module}/0/sha256"] == {"local": want, "sync": want}
    seen = info["cgroup"]
    # The limit held (the page cache of the table was reclaimed as the rows were read)...
    assert seen["table_bytes"] == every.numel()
    assert seen["failcnt"] > 0 and seen["max_usage"] <= seen["limit"], seen
    assert seen["cache"] < seen["table_bytes"] / 2, seen


def test_a_daemon_restart_between_steps_changes_nothing_a_rank_reads(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    model = ple_models["F8_E4M3"]
    d = _on_disk(daemons, model, tmp_path)
    out = tmp_path / "looked.pt"
    rank = subprocess.Popen(
        [
            *(sys.executable, str(PLE_RANK), "0", "1", str(tmp_path / "init"), str(model.config)),
            *("--no-load", "--lookup", str(out), "--pause"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ENGRAMD_SOCKET": str(d.socket)},
    )
    try:
        assert rank.stdout is not None and rank.stdin is not None
        for line in rank.stdout:
            if line.strip() == "PAUSED":
                break
        d.stop()
        again = daemons(*d.args)
        (s,) = again.status().sets
        assert s.adopted and s.backing == "disk"
        rank.stdin.write("go\n")
        rank.stdin.flush()
        _, stderr = rank.communicate(timeout=300)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert rank.returncode == 0, stderr[-3000:]
    saved = torch.load(out)
    first, second = _check_lookups(model, saved, 0), _check_lookups(model, saved, 1)
    assert first == second > 0


def test_etp_spanning_dp_ranks_reads_each_replicas_rows(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    # Two DP replicas of TP 2, the tables split over all 4 ranks (embedding_across_dp): each
    # replica's tokens gathered over DP, each rank reading its quarter.
    model = ple_models["NVFP4"]
    d = _on_disk(daemons, model, tmp_path)
    env = {"ENGRAMD_SOCKET": str(d.socket)}
    runs = _run(model, 4, env, tmp_path / "dp", "--dp", "2", "--no-load")
    for rank, (info, saved, _) in enumerate(runs):
        for layer in info["layers"].values():
            assert layer["etp"] == [rank, 4]
        assert _check_lookups(model, saved) > 0


def test_a_worker_asks_for_host_reads_on_a_memory_backing_or_refuses_them(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path
) -> None:
    model = ple_models["BF16"]
    d = daemons("--checkpoint", str(model.folder))
    env = {"ENGRAMD_SOCKET": str(d.socket), "ENGRAMD_DISK_OFFLOAD": "on"}
    ((_, saved, log),) = _run(model, 1, env, tmp_path / "on")
    assert _check_lookups(model, saved) > 0
    assert "read each step on the host from the daemon's file" in log
    # Refused on the disk backing: the layer holds the daemon's rows as before, which vLLM's
    # own UVA kernel reads (it needs a GPU: not looked up here).
    d.stop()
    disk = _on_disk(daemons, model, tmp_path)
    env = {"ENGRAMD_SOCKET": str(disk.socket), "ENGRAMD_DISK_OFFLOAD": "off"}
    (done,) = run_ple_ranks(model, 1, env, tmp_path, ("--no-load",))
    out = result(done)
    assert "read each step on the host" not in done.stdout + done.stderr
    for layer in out["layers"].values():
        assert str(disk.disk) in layer["maps"]["weight"]


@pytest.mark.parametrize("fmt", list(PLE_DTYPES))
def test_without_a_daemon_the_rows_come_from_the_checkpoints_files_with_one_warning(
    ple_models: dict[str, PleModel], tmp_path: Path, fmt: str
) -> None:
    model = ple_models[fmt]
    env = {"ENGRAMD_SOCKET": str(tmp_path / "none.sock"), "ENGRAMD_DISK_OFFLOAD": "on"}
    evict = ("--evict", str(model.folder))
    ((info, saved, log),) = _run(model, 1, env, tmp_path / "run", *evict)
    assert log.count(WARNING) == 1, log[-3000:]
    assert "read on the host from" in log and "own files" in log
    assert _check_lookups(model, saved) > 0
    for layer in info["layers"].values():
        # No table: a one-row placeholder, the rows read from the shards' files.
        assert layer["served"] == list(model.spec.widths())
        for part, (_, width) in model.spec.widths().items():
            assert layer["storage_bytes"][part] == width, layer
    assert info["cached"][str(model.folder)] > 0


def test_a_checkpoint_with_no_files_here_runs_vllms_own_tables_and_says_their_memory(
    ple_models: dict[str, PleModel], daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An s3:// model streamed by runai_streamer with no daemon to serve it: there are no
    files on the node to read rows from, so ENGRAMD_DISK_OFFLOAD=on gives way to vLLM's own
    pinned tables, with one warning that says so and names the memory they take."""
    model = ple_models["BF16"]
    with bucket_config(model.folder, daemons, tmp_path, monkeypatch) as (pulled, pickled, bucket):
        bucket.daemon.stop()
        env = {**bucket.env, "ENGRAMD_DISK_OFFLOAD": "on"}
        extra = ("--private-pin", "--no-load")
        (done,) = run_ple_ranks(PleModel(pulled, pickled, model.spec), 1, env, tmp_path, extra)
    out, log = result(done), done.stdout + done.stderr
    assert log.count(WARNING) == 1, log[-3000:]
    assert "ENGRAMD_DISK_OFFLOAD=on cannot read the PLE rows" in log
    assert "pinned host memory of this process for 1/1 of every PLE table" in log
    for layer in out["layers"].values():
        assert layer["served"] == [] and " r--s " not in layer["maps"]["weight"]
        assert layer["storage_bytes"]["weight"] == layer["nbytes"]["weight"]


def test_a_changed_lookup_seam_disables_the_plugin_for_ple() -> None:
    """The rows read on the host replace `_lookup`, which both entry points call: a vLLM whose
    `_lookup` or NVFP4 decode differ is not the one they were read from."""
    import vllm.models.qwen4_exp.common.ngram_embedding as ple

    from engramd_client.engines.common import UnknownEngine
    from engramd_client.engines.vllm.guard import check_ple_seams

    table = ple.Qwen4ExpPLEPinnedHostEmbedding
    check_ple_seams(ple)
    original = table._lookup

    def renamed(self: Any, ids: torch.Tensor, out: Any = None) -> Any:
        return None

    try:
        table._lookup = renamed
        with pytest.raises(UnknownEngine, match=r"Qwen4ExpPLEPinnedHostEmbedding\._lookup"):
            check_ple_seams(ple)
    finally:
        table._lookup = original
