"""What an object store can make a planning node spend (`--checkpoint s3://...`): the S3
endpoint is a Python HTTP server in another network namespace (tests/support/lying_s3.py),
the node a real daemon. One trickles its head, one serves headers of many entries, one a
header of a large tensor with no attested manifest: each costs the node only its own
checkpoint, within the bounds docs/fleet.md states."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import daemon.test_fleet as fleet
from fleet_nodes import lying_store, ready_set

from conftest import wait_until
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import INDEX_FILE, plan_tables
from engramd_shared.layout import LOCK_NAME, sets_root
from fleet_lab import S3, Net
from helpers import engramd

pytestmark = fleet.pytestmark
s3 = fleet.s3

#: What the store's one bucket is called, in s3rver and at the liar alike.
URL = "s3://tables/m"
#: What all plannings may hold at once, as docs/fleet.md states it.
PLANNING_BYTES = 384 << 20


def _peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmHWM for pid {pid}")


def _write_safetensors(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    """A safetensors file of `header` whose data is `data_bytes` of zeros (sparse)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + data_bytes)


def _index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_store_that_trickles_its_head_delays_only_its_own_checkpoint(
    s3: S3, net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    """The node filled its set from the bucket; restarted, the endpoint answers every GET
    with a status line and then a header byte a second. The node serves at once, its other
    checkpoint (files) is loaded meanwhile, and once the request's deadline (30 s) passes
    the held attested copy is served: the daemon becomes ready."""
    s3.upload(checkpoint, "m")
    s3.attest(checkpoint, "m", token_file)
    node = nodes("s")
    args = ["--checkpoint", URL, "--peer-token-file", str(token_file)]
    held = ready_set(node.start(args, env=s3.env()))
    node.daemon.stop()
    local = synthesize(tmp_path / "local", SynthSpec(rows=4000, seed=3))
    bucket = tmp_path / "bucket"
    shutil.copytree(checkpoint, bucket)
    with lying_store(net, bucket, "head") as env:
        d = node.start([*args, "--checkpoint", str(local)], net.a, env=env)
        by_id = {s.set_id: s for s in d.status().sets}
        assert by_id[plan_tables(local).set_id].state in ("loading", "ready")
        wait_until(lambda: d.status().daemon.ready, 120, "the held attested copy to be served")
        assert f"cannot plan configured checkpoint {URL}" in d.log
        assert "no whole reply within 30 s (status line, headers and body)" in d.log
        assert f"serving set {held.set_id}" in d.log
        states = {s.set_id: (s.state, s.published) for s in d.status().sets}
        assert states == {
            held.set_id: ("ready", True),
            plan_tables(local).set_id: ("ready", True),
        }


def test_headers_of_many_entries_are_refused_within_the_planning_memory(
    net: Net, nodes: Any, token_file: Path, tmp_path: Path
) -> None:
    """Two objects of 400,000 zero-size tensors each (about 24 MB of headers apiece): the
    planning is refused before they are parsed, naming the limit, and the daemon's peak
    memory stays under it."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    names = [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    weight_map = {}
    for k, name in enumerate(names):
        header = {
            f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w{k}": {
                "dtype": "F32",
                "shape": [0],
                "data_offsets": [0, 0],
            }
            for i in range(400_000)
        }
        _write_safetensors(bucket / name, header, 0)
        weight_map[next(iter(header))] = name
    _index(bucket, weight_map)
    with lying_store(net, bucket, "honest") as env:
        d = nodes("s").start(
            ["--checkpoint", URL, "--peer-token-file", str(token_file)], net.a, env=env
        )
        wait_until(lambda: bool(d.status().daemon.failed_checkpoints), 120, "the refusal")
        assert d.proc is not None
        assert _peak_rss(d.proc.pid) < PLANNING_BYTES, d.log
        [failed] = d.status().daemon.failed_checkpoints
        assert f"would take more than {PLANNING_BYTES >> 20} MiB of memory" in failed.error
        assert not d.status().sets


def test_a_large_tensor_with_no_attestation_reserves_nothing(
    net: Net, nodes: Any, token_file: Path, tmp_path: Path
) -> None:
    """The bucket's header names a 1 GiB table and no attested manifest is beside it: the
    node plans it, finds no attestation of the fleet's key covering it, and never makes a set
    of it (nothing reserved, nothing evicted); it says why and the fix."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    name = "model.safetensors"
    table = "layers.1.engram.embed.weight"
    rows = 1 << 22  # of 256 bytes: 1 GiB
    header = {table: {"dtype": "F8_E4M3", "shape": [rows, 256], "data_offsets": [0, rows * 256]}}
    _write_safetensors(bucket / name, header, rows * 256)
    _index(bucket, {table: name})
    with lying_store(net, bucket, "honest") as env:
        d = nodes("s").start(
            ["--checkpoint", URL, "--peer-token-file", str(token_file)], net.a, env=env
        )
        wait_until(lambda: bool(d.status().daemon.failed_checkpoints), 120, "the refusal")
        assert not d.status().sets
        [failed] = d.status().daemon.failed_checkpoints
        assert "no attestation of the fleet's key covers the set" in failed.error, failed.error
        assert "nothing was reserved" in failed.error and "engramd manifest" in failed.error
        assert "loading set" not in d.log
        shown = engramd("status", "--socket", str(d.socket))
        assert "no attestation" in shown.stdout, shown.stdout
        assert [p.name for p in sets_root(d.shm_dir).iterdir()] == [LOCK_NAME]
        assert os.path.getsize(bucket / name) > 1 << 30
