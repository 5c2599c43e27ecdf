"""The daemon's kept plans: a checkpoint is planned once while every file's identity holds.

Workers attaching together name the same checkpoint; each attach must still
see the checkpoint as it is now. Replaced, edited, added or re-pointed files
are planned again, and a changed file is then caught by the proof.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import mounted_tmpfs, wait_until
from engramd.sets import plans as plans_module
from engramd.sets.plans import LARGE_HEADER_BYTES, WORKER_HEADER_BYTES, PlanCache
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared import headers
from engramd_shared.beneath import Root
from engramd_shared.checkpoint import DEFAULT_TENSORS, plan_tables
from engramd_shared.errors import ReadersBusy
from engramd_shared.headers import SAMPLE_BYTES, SAMPLES
from engramd_shared.pb import engramd_pb2 as pb
from helpers import attach_error, bytes_read, reason

SHARD = "model-00002-of-00002.safetensors"


def _edit_between_samples(shard: Path) -> None:
    """Change 4 KiB of data that no fingerprint sample reads (the set id stays)."""
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        offset = start + (size - start - SAMPLE_BYTES) * (SAMPLES - 1) // (2 * (SAMPLES - 1))
        with mmap.mmap(f.fileno(), 0) as m:
            m[offset : offset + 4096] = bytes(b ^ 0x5A for b in m[offset : offset + 4096])


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def test_an_unchanged_checkpoint_is_planned_once(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(checkpoint, tmp_path / "engram")
    plans = PlanCache()
    first = plans.plan(ckpt, DEFAULT_TENSORS)
    assert plans.plan(ckpt, DEFAULT_TENSORS) is first
    assert first == plan_tables(ckpt)
    # Another selection is another plan.
    assert plans.plan(ckpt, "*") is not first


def test_every_change_of_a_file_is_planned_again(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(checkpoint, tmp_path / "engram")
    plans = PlanCache()
    kept = plans.plan(ckpt, DEFAULT_TENSORS)

    # Written in place (same inode, the set id stays): new mtime and ctime.
    _edit_between_samples(ckpt / SHARD)
    edited = plans.plan(ckpt, DEFAULT_TENSORS)
    assert edited is not kept and edited.set_id == kept.set_id
    assert edited.sources != kept.sources
    assert edited.sources == plan_tables(ckpt).sources

    # Renamed over by another file.
    shutil.copy(checkpoint / SHARD, tmp_path / "new")
    os.replace(tmp_path / "new", ckpt / SHARD)
    replaced = plans.plan(ckpt, DEFAULT_TENSORS)
    assert replaced is not edited
    assert replaced.sources == plan_tables(ckpt).sources

    # A shard named through a symlink, re-pointed elsewhere (in another folder).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(checkpoint / SHARD, elsewhere / "a")
    shutil.copy(checkpoint / SHARD, elsewhere / "b")
    (ckpt / SHARD).unlink()
    (ckpt / SHARD).symlink_to(elsewhere / "a")
    linked = plans.plan(ckpt, DEFAULT_TENSORS)
    assert str(elsewhere / "a") in {s.path for s in linked.sources}
    os.replace(elsewhere / "b", elsewhere / "a")
    assert (
        plans.plan(ckpt, DEFAULT_TENSORS).sources == plan_tables(ckpt).sources != (linked.sources)
    )

    # A file added to the folder changes the fingerprint, so the plan too.
    before = plans.plan(ckpt, DEFAULT_TENSORS)
    shutil.copy(checkpoint / SHARD, ckpt / "model-extra.safetensors")
    added = plans.plan(ckpt, DEFAULT_TENSORS)
    assert added is not before and added == plan_tables(ckpt)


def test_checkpoints_on_tmpfs_are_planned_at_every_attach(checkpoint: Path) -> None:
    with mounted_tmpfs("64m") as mount:
        ckpt = _copy(checkpoint, mount / "engram")
        plans = PlanCache()
        # tmpfs keeps mtime and ctime through a shared mapping: identity proves nothing.
        assert plans.plan(ckpt, DEFAULT_TENSORS) is not plans.plan(ckpt, DEFAULT_TENSORS)


def test_a_file_edited_between_two_attaches_is_not_served(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    ckpt = _copy(checkpoint, tmp_path / "engram")
    d = daemons("--checkpoint", str(ckpt))
    request = pb.AttachRequest(set_id=plan_tables(ckpt).set_id, checkpoint=str(ckpt))
    assert attach_error(d, request) is None
    assert attach_error(d, request) is None
    # The set id stays; the kept plan's identities would prove the old bytes.
    _edit_between_samples(ckpt / SHARD)
    err = attach_error(d, request)
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(err) == "fingerprint", err.details()
    assert "changed on disk after engramd loaded it" in (err.details() or "")


def test_the_first_attach_to_a_configured_checkpoint_reads_no_header(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    ckpt = _copy(checkpoint, tmp_path / "engram")
    d = daemons("--checkpoint", str(ckpt))
    assert d.proc is not None
    request = pb.AttachRequest(set_id=plan_tables(ckpt).set_id, checkpoint=str(ckpt))
    # After the set is ready the daemon measures its pages (its own smaps),
    # locks them and reads numa_maps for the nodes holding them (tens to
    # hundreds of KiB): the last of those reads must be over before counting.
    wait_until(
        lambda: all(s.bytes_per_node for s in d.status().sets),
        30,
        "the daemon to lock the set and read where its pages are",
    )
    before = bytes_read(d.proc.pid)
    assert attach_error(d, request) is None
    # The daemon's plan from its start is kept: not one data sample is read again.
    assert bytes_read(d.proc.pid) - before < SAMPLE_BYTES * SAMPLES


def _padded(checkpoint: Path, to: Path, header_bytes: int) -> Path:
    """A copy of `checkpoint` whose first shard's header is padded to about `header_bytes`."""
    shutil.copytree(checkpoint, to)
    shard = sorted(to.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    doc = json.loads(data[8 : 8 + length])
    doc["__metadata__"] = {**doc.get("__metadata__", {}), "pad": "x" * header_bytes}
    header = json.dumps(doc).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length :])
    return to


def test_a_workers_checkpoint_gets_a_tighter_header_limit(
    daemons: Any, tmp_path: Path, open_dirs: tuple[Path, Path, Path]
) -> None:
    # Files any member may read: the refusal names the problem.
    top = open_dirs[0]
    small = synthesize(tmp_path / "small", SynthSpec(rows=2000))
    padded = _padded(small, top / "padded", WORKER_HEADER_BYTES + 1)
    for p in (padded, *padded.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    d = daemons("--allow-root", str(top))
    err = attach_error(
        d, pb.AttachRequest(set_id=plan_tables(padded).set_id, checkpoint=str(padded))
    )
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"longer than the {WORKER_HEADER_BYTES} engramd reads" in str(err.details())
    assert "engramd load" in str(err.details())


def test_large_headers_of_one_owner_are_read_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = synthesize(tmp_path / "small", SynthSpec(rows=2000))
    root = tmp_path / "root"
    mine = [_padded(small, root / f"mine{i}", LARGE_HEADER_BYTES) for i in range(3)]
    theirs = _padded(small, root / "theirs", LARGE_HEADER_BYTES)
    for folder, uid in [*((m, 60152) for m in mine), (theirs, 60151)]:
        for p in (folder, *folder.iterdir()):
            os.chown(p, uid, uid)
    # Parses that wait for the test: the reads they stand for are slow, not hung.
    entered = threading.Semaphore(0)
    release = threading.Event()
    cache = headers._HEADERS
    real = cache.parsed

    def slow(source: Any, header: bytes, parse: Any) -> Any:
        if len(header) >= LARGE_HEADER_BYTES:
            entered.release()
            assert release.wait(60), "the test never released the parses"
        return real(source, header, parse)

    monkeypatch.setattr(cache, "parsed", slow)
    plans = PlanCache()
    results: list[Any] = []

    def plan(folder: Path) -> None:
        results.append(plans.plan(folder, DEFAULT_TENSORS, Root(root)))

    threads = [threading.Thread(target=plan, args=(m,)) for m in (*mine[:2], theirs)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert entered.acquire(timeout=30), "the large headers were not read at once"
        # A third large header of the same owner is refused at once; another owner's was not.
        with pytest.raises(ReadersBusy, match="files of uid 60152"):
            plans.plan(mine[2], DEFAULT_TENSORS, Root(root))
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert len(results) == 3
    # The owner's share of the daemon's time is spent (the parses took as long as the test
    # held them): the next large header waits for it, refused at once meanwhile.
    with pytest.raises(ReadersBusy, match="share of its time"):
        plans.plan(mine[2], DEFAULT_TENSORS, Root(root))
    monkeypatch.setattr(plans_module, "LARGE_HEADER_SHARE", 1.0)
    plans = PlanCache()
    assert plans.plan(mine[2], DEFAULT_TENSORS, Root(root)).set_id == results[0].set_id
