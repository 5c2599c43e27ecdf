"""A node with no file of its checkpoint (`--checkpoint s3://bucket/prefix`, issue 47): the
set planned from the objects' headers under the id a folder of the same files gets, filled
from the bucket or a peer and trusted by the fleet's attested manifest alone, attached by
workers by the URL. Real daemons, a real s3rver, real workers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import daemon.test_fleet as fleet
import pytest
from fleet_nodes import checkpoint_digests, lying_store, ready_set, set_digests

from conftest import Worker, wait_until
from engramd.fleet.objectplan import plan_objects
from engramd.testing.synth import SynthSpec, synthesize
from engramd_client import attach, describe
from engramd_shared.checkpoint import INDEX_FILE, plan_tables
from engramd_shared.errors import CheckpointError
from fleet_lab import S3, Net, free_port
from helpers import engramd, reference_digests

pytestmark = fleet.pytestmark
s3 = fleet.s3
ple_checkpoint = fleet.ple_checkpoint


def _put_all(s3: S3, folder: Path, prefix: str, index: bool) -> None:
    """Every file of `folder` under `prefix` (its index only with `index`)."""
    for f in sorted(folder.iterdir()):
        if f.name != INDEX_FILE or index:
            s3.put(f"{prefix}/{f.name}", f.read_bytes())


@pytest.mark.parametrize("kind", ["engram, with its index", "ple, listed"])
def test_objects_are_planned_as_the_folder_of_the_same_files(
    s3: S3, checkpoint: Path, ple_checkpoint: Path, kind: str
) -> None:
    """The set id, selection and tensors planned from the objects' headers are the local
    folder's: with an index, and without one (the prefix's *.safetensors, listed), the
    family from config.json."""
    folder = checkpoint if kind.startswith("engram") else ple_checkpoint
    _put_all(s3, folder, "deep/ckpt", index=kind.endswith("index"))
    remote = plan_objects(f"s3://{s3.bucket}/deep/ckpt/", "auto", s3.env())
    local = plan_tables(folder)
    assert (remote.set_id, remote.fingerprint, remote.selection) == (
        local.set_id,
        local.fingerprint,
        local.selection,
    )
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in remote.tensors] == [
        (t.name, t.dtype, t.shape, t.nbytes) for t in local.tensors
    ]
    assert remote.where == f"s3://{s3.bucket}/deep/ckpt" and not remote.sources
    assert remote.objects == {f.name: f.stat().st_size for f in folder.glob("*.safetensors")}


def test_objects_that_cannot_be_a_checkpoint_are_refused_with_the_fix(
    s3: S3, checkpoint: Path
) -> None:
    """No objects under the prefix, a truncated object, and a key the store does not know: each a
    CheckpointError that names the object and what to do."""
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors objects"):
        plan_objects(f"s3://{s3.bucket}/empty", "auto", s3.env())
    first = sorted(checkpoint.glob("*.safetensors"))[0]
    s3.put(f"cut/{first.name}", first.read_bytes()[:4096])
    cut = f"s3://{s3.bucket}/cut/{first.name}: tensor .* upload the file again"
    with pytest.raises(CheckpointError, match=cut):
        plan_objects(f"s3://{s3.bucket}/cut", "auto", s3.env())
    wrong = {**s3.env(), "AWS_ACCESS_KEY_ID": "nobody"}
    s3.upload(checkpoint, "m")
    denied = "HTTP 403 \\(InvalidAccessKeyId\\); check the URL, the AWS_ variables"
    with pytest.raises(CheckpointError, match=denied):
        plan_objects(f"s3://{s3.bucket}/m", "auto", wrong)


def _in_bucket(s3: S3, checkpoint: Path, token_file: Path) -> str:
    """`checkpoint`'s files and attested manifest under the bucket's prefix "m"; its URL."""
    s3.upload(checkpoint, "m")
    s3.attest(checkpoint, "m", token_file)
    return f"s3://{s3.bucket}/m"


def _stored_node(nodes: Any, s3: S3, token_file: Path, *extra: str) -> Any:
    node = nodes("s")
    url = f"s3://{s3.bucket}/m"
    node.start(["--checkpoint", url, "--peer-token-file", str(token_file), *extra], env=s3.env())
    return node


def test_a_node_with_no_files_fills_from_the_bucket_and_serves_workers_by_the_url(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """The bucket holds the files and the attested manifest, the node none of them: the set
    comes from the bucket, its bytes the checkpoint's; status names the URL; a worker
    attaching with the URL maps exactly those bytes, shared."""
    url = _in_bucket(s3, checkpoint, token_file)
    node = _stored_node(nodes, s3, token_file)
    d = node.daemon
    s = ready_set(d)
    assert (s.set_id, s.checkpoint, s.source) == (plan_tables(checkpoint).set_id, url, url)
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    shown = engramd("status", "--socket", str(d.socket))
    assert url in shown.stdout and "ready" in shown.stdout, shown.stdout
    _attaches_by_url(url, d, checkpoint)


def _attaches_by_url(url: str, d: Any, checkpoint: Path) -> None:
    """A worker naming `url` maps exactly the checkpoint's bytes, shared."""
    worker = Worker(url, d.socket, share="on")
    try:
        assert worker.hello["mode"] == "shared", worker.hello
        assert worker.hello["digests"] == reference_digests(checkpoint)
    finally:
        worker.exit()


def test_a_restart_keeps_serving_the_held_copy_even_while_the_store_is_unreachable(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """Restarted, the daemon plans the objects again and adopts its copy (the fleet's
    attestation stands in for files to prove it with); restarted again with the store out of
    reach, it cannot plan, says so, and serves the attested copy it holds."""
    url = _in_bucket(s3, checkpoint, token_file)
    node = _stored_node(nodes, s3, token_file)
    loaded = ready_set(node.daemon)
    node.daemon.stop()
    d = node.restart()
    s = ready_set(d)
    assert (s.set_id, s.source, s.checkpoint) == (loaded.set_id, "adopted", url), d.log
    _attaches_by_url(url, d, checkpoint)
    d.stop()
    away = {**s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    args = ["--checkpoint", url, "--peer-token-file", str(token_file)]
    d = node.start(args, env=away)
    s = ready_set(d)
    assert (s.set_id, s.source) == (loaded.set_id, "adopted"), d.log
    assert d.status().daemon.ready and not d.status().daemon.failed_checkpoints
    assert f"cannot plan configured checkpoint {url}" in d.log
    assert "serving set " + loaded.set_id in d.log
    _attaches_by_url(url, d, checkpoint)


def test_without_an_attested_manifest_nothing_is_served(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """The bucket holds the files but no attested manifest and no peer holds the set: the
    checkpoint fails with why and the fix before a set is made of it (nothing reserved);
    a worker naming the URL is told no set was loaded from it."""
    s3.upload(checkpoint, "m")
    url = f"s3://{s3.bucket}/m"
    d = _stored_node(nodes, s3, token_file).daemon

    def failed() -> bool:
        return bool(d.status().daemon.failed_checkpoints)

    wait_until(failed, 120, "the checkpoint to fail")
    assert not d.status().sets
    (f,) = d.status().daemon.failed_checkpoints
    assert f.checkpoint == url
    assert f"no attestation of the fleet's key covers the set of {url}" in f.error, f.error
    assert "no attested manifest there" in f.error and "engramd manifest" in f.error
    worker = Worker(url, d.socket, share="on", wait=False)
    try:
        assert worker.greeted().hello["error"] == "UnknownSet", worker.hello
    finally:
        worker.exit()


def test_a_node_with_no_files_fills_from_a_warm_peer(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """A warm node A loaded the checkpoint from its folder; B, given only the URL, plans the
    same set id from the objects and takes pieces from A (and the bucket): its bytes are the
    checkpoint's."""
    s3.upload(checkpoint, "m")
    peer = f"127.0.0.1:{free_port()}"
    a = nodes("a")
    args = ["--peer-token-file", str(token_file)]
    ready_set(a.start(["--checkpoint", str(checkpoint), *args, "--peer-listen", peer]))
    b = _stored_node(nodes, s3, token_file, "--peers", peer)
    s = ready_set(b.daemon)
    assert s.set_id == plan_tables(checkpoint).set_id
    assert dict(s.bytes_by_source).get(peer, 0) > 0, (s.bytes_by_source, b.daemon.log)
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def test_a_joined_table_attached_by_the_url_names_its_row_shards(
    s3: S3, nodes: Any, ple_checkpoint: Path, token_file: Path
) -> None:
    """Qwen4Exp's PLE tables, each joined from row shards, from the bucket: a worker
    attaching with the URL has no plan of its own, and the daemon tells it each table's
    shards (what an engine's loader skips) and their rows, in order (what an engine that
    places the shards itself checks, before it chooses its rows); the bytes are the
    checkpoint's."""
    url = _in_bucket(s3, ple_checkpoint, token_file)
    node = _stored_node(nodes, s3, token_file)
    s = ready_set(node.daemon)
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(ple_checkpoint)
    local = plan_tables(ple_checkpoint)
    with attach(url, socket=str(node.daemon.socket), share=True) as tables:
        assert tables.set_id == local.set_id
        assert tables.checkpoint_names == {p for n in local.checkpoint_names.values() for p in n}
        assert all(len(parts) > 1 for parts in local.checkpoint_names.values())
    described = describe(url, socket=str(node.daemon.socket))
    assert described == describe(ple_checkpoint)
    assert [t.part_rows for t in described] == [
        tuple(p.shape[0] for p in t.parts) for t in local.tensors
    ]
    assert all(sum(t.part_rows) == t.shape[0] and len(t.part_rows) > 1 for t in described)
    # Nothing of it stays held for the worker that only asked.
    wait_until(lambda: not node.daemon.status().sets[0].lease_count, 30, "the lease to end")


def test_a_new_version_in_the_bucket_is_what_the_url_names_once_loaded(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    """The operator uploads another version over the prefix (and its attested manifest) and
    runs `engramd load URL`: the new set is what workers attaching by the URL get, the
    set's next generation (the same shapes); the old one, which no worker holds, is dropped
    (docs/operations.md: rolling out a new revision)."""
    url = _in_bucket(s3, checkpoint, token_file)
    node = _stored_node(nodes, s3, token_file)
    d = node.daemon
    old = ready_set(d)
    newer = synthesize(tmp_path / "v2", SynthSpec(rows=40_000, seed=1))
    assert _in_bucket(s3, newer, token_file) == url
    loaded = engramd("load", url, "--socket", str(d.socket))
    assert loaded.returncode == 0, loaded.stderr
    new_id = plan_tables(newer).set_id
    assert new_id != old.set_id
    wait_until(
        lambda: {s.set_id for s in d.status().sets} == {new_id}, 30, "the old version dropped"
    )
    (now,) = d.status().sets
    assert (now.published, now.generation, now.checkpoint) == (True, 2, url)
    with attach(url, socket=str(d.socket), share=True) as tables:
        assert tables.set_id == new_id
    assert set_digests(node.shm_dir, new_id) == checkpoint_digests(newer)


#: Why each lie leaves the set unserved: the planning, or the fill.
WHY = {
    "late": "cannot plan the checkpoint at s3://bucket/m",
    "window": "no source could give the set of s3://bucket/m",
    "whole": "the server ignored the Range header",
    "more": "cannot read the set's attested manifest",
}


@pytest.mark.parametrize("lie", sorted(WHY))
def test_a_lying_store_of_the_only_source_serves_nothing_and_the_daemon_lives(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path, lie: str
) -> None:
    """The node has only the URL; the S3 endpoint, in another namespace, holds the files and
    the attested manifest and lies (tests/support/lying_s3.py): the header's range refused,
    a table window refused mid-fill, Range ignored, or more bytes than asked. Nothing is
    published (no spot check stands in for the files here: the planning's checks and the
    attested digests do), no staged set is left, and the daemon answers on."""
    bucket = tmp_path / "bucket"
    shutil.copytree(checkpoint, bucket)
    made = engramd(
        *("manifest", str(checkpoint), "--peer-token-file", str(token_file)),
        *("-o", str(bucket / f"engramd-manifest-{plan_tables(checkpoint).set_id}.json")),
    )
    assert made.returncode == 0, made.stderr
    with lying_store(net, bucket, lie) as env:
        url = "s3://bucket/m"
        d = nodes("s").start(
            ["--checkpoint", url, "--peer-token-file", str(token_file)],
            net.a,
            env=env,
        )

        def refused() -> bool:
            return bool(d.status().daemon.failed_checkpoints)

        wait_until(refused, 120, "the checkpoint to be refused")
        status = d.status()
        assert [f.checkpoint for f in status.daemon.failed_checkpoints] == [url], d.log
        assert WHY[lie] in status.daemon.failed_checkpoints[0].error, d.log
        assert not status.daemon.ready and all(s.state != "ready" for s in status.sets)
        assert d.proc is not None and d.proc.poll() is None, d.log
        assert fleet.no_partial_loads(d.shm_dir)
