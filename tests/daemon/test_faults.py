"""Faults injected for real: daemon killed mid-load and mid-lookup, tmpfs filling up, churn,
checkpoints changing on disk, corrupted tables."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import Daemon, Worker, mounted_tmpfs, start_workers, wait_until
from engramd.backings import StagedSet, TmpfsBacking
from engramd.checksum import BUFFER_BYTES, digest_fd
from engramd.sets.loader import LoadProgress, load_set
from engramd.testing.synth import SynthSpec, synthesize
from engramd_client import plan_tables
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import (
    LOADING_MARK,
    Manifest,
    check_complete,
    read_manifest,
    sets_root,
)
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import reason, set_folders


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300 MB of tables: a load long enough to be killed at many points."""
    return synthesize(tmp_path_factory.mktemp("big") / "engram", SynthSpec(rows=600_000))


def start_load(d: Daemon, ckpt: Path) -> tuple[grpc.Channel, Any]:
    """Ask the daemon for a set it does not hold: it starts loading at once."""
    plan = plan_tables(ckpt)
    channel = d.channel()
    call = pb_grpc.TableServiceStub(channel).Attach(
        pb.AttachRequest(
            set_id=plan.set_id,
            checkpoint=str(ckpt),
            pid=os.getpid(),
            # Paths go out for sets the operator published only.
            accept=[pb.HANDLE_KIND_FD],
        )
    )
    return channel, call


def test_sigkill_at_any_point_of_a_load(big_checkpoint: Path, daemons: Any) -> None:
    d = daemons("--allow-root", str(big_checkpoint.parent), "--load-threads", "1")
    channel, call = start_load(d, big_checkpoint)
    start = time.monotonic()
    for event in call:
        if event.WhichOneof("event") == "attached":
            break
    took = time.monotonic() - start
    call.cancel()
    channel.close()
    d.stop()
    root = sets_root(d.shm_dir)
    expected = {f"{t.name}": t for t in plan_tables(big_checkpoint).tensors}
    outcomes = []
    for i in range(12):
        shutil.rmtree(root, ignore_errors=True)
        d.start()
        channel, call = start_load(d, big_checkpoint)
        if i < 11:
            # From the reservation (i = 0) on through the copy and the publish.
            time.sleep(took * i / 8)
        else:
            # And once the set is published and handed out.
            next(e for e in call if e.WhichOneof("event") == "attached")
        d.stop(signal.SIGKILL)
        call.cancel()
        channel.close()
        partial = [p for p in root.iterdir() if LOADING_MARK in p.name]
        complete = [p for p in set_folders(d.shm_dir) if LOADING_MARK not in p.name]
        for folder in complete:  # anything under a set's name is whole
            manifest = read_manifest(folder, os.geteuid())
            check_complete(folder, manifest, os.geteuid())
            assert {t.name for t in manifest.tensors} == set(expected)
        outcomes.append("published" if complete else "partial" if partial else "nothing")
        d.start()
        assert not [p for p in root.iterdir() if LOADING_MARK in p.name], "leftovers kept"
        w = Worker(big_checkpoint, d.socket, share="on")
        assert w.hello["mode"] == "shared"
        sample = w.ask("lookups 0.2")
        assert sample["bad"] == 0 and sample["lookups"] > 0
        assert w.exit() == 0
        d.stop()
    # The kills landed before or during the copy, and after the publish.
    assert {"nothing", "partial"} & set(outcomes) and outcomes[-1] == "published", outcomes


def test_tmpfs_filled_by_another_writer(checkpoint: Path, sock_dir: Path, tmp_path: Path) -> None:
    plan = plan_tables(checkpoint)
    with mounted_tmpfs("40m") as shm:
        # The loader reserves every byte before it copies: when another writer
        # took the space after the capacity check, the load fails cleanly.
        filler = shm / "other-writer"
        filler.write_bytes(b"\1" * (shutil.disk_usage(shm).free - plan.nbytes // 2))
        backing = TmpfsBacking(str(shm), None)
        backing.claim()
        with pytest.raises(ShmCapacityError, match="ran out of space while reserving"):
            load_set(plan, backing, 2, LoadProgress(plan.nbytes))
        assert [p.name for p in set_folders(shm)] == []
        filler.unlink()
        backing.release()  # the daemon below takes the shm folder: one per folder

        # The daemon, racing a writer that fills the tmpfs while it loads:
        # every attempt ends loaded or refused, never a SIGBUS or a leftover.
        # One tmpfs for the sets and the writer, so the kernel's ENOSPC takes
        # part in the race (a huge-page mount of the daemon's own is another
        # tmpfs, judged against this one at the check: test_huge_default).
        tiny = synthesize(tmp_path / "tiny", SynthSpec(rows=2_000))
        d = Daemon(
            sock_dir / "d.sock",
            shm,
            ["--checkpoint", str(tiny), "--allow-root", str(checkpoint.parent), "--no-huge-tmpfs"],
            sock_dir / "daemon.log",
        ).start()
        try:
            outcomes = [_load_against_a_filler(d, checkpoint, shm, n) for n in range(6)]
            assert "refused" in outcomes, outcomes
            assert d.proc is not None and d.proc.poll() is None, "the daemon died"
            tiny_sets = [s.state for s in d.status().sets if s.checkpoint == str(tiny)]
            assert tiny_sets == ["ready"]  # other sets still served
            w = Worker(tiny, d.socket, share="on")
            assert w.hello["mode"] == "shared"
            assert w.ask("lookups 0.2")["bad"] == 0
            assert w.exit() == 0
        finally:
            d.stop()


class _WatchedStage(StagedSet):
    """The tmpfs backing's staged set, writing through; one piece of the largest tensor can be
    made to wait for a write of another piece by another thread, or to fail."""

    def __init__(self, inner: StagedSet, big: int, fail: bool) -> None:
        self._inner = inner
        self._big = big
        self._fail = fail
        self.other_thread_wrote = threading.Event()
        self._first: int | None = None

    def placement(self, index: int) -> tuple[str, int]:
        return self._inner.placement(index)

    def write(self, index: int, data: memoryview, offset: int) -> None:
        if index == self._big and offset == 2 * BUFFER_BYTES and self._fail:
            raise OSError(errno.EIO, "injected write error")
        if index == self._big and offset == 0:
            self._first = threading.get_ident()
            # The old loader copied a tensor on one thread: this would time out.
            assert self.other_thread_wrote.wait(60), "no other thread copied this tensor"
        elif index == self._big and self._first not in (None, threading.get_ident()):
            self.other_thread_wrote.set()
        self._inner.write(index, data, offset)

    def publish(self, manifest: Manifest) -> None:
        self._inner.publish(manifest)

    def discard(self) -> None:
        self._inner.discard()


class _WatchedTmpfs(TmpfsBacking):
    def __init__(self, shm: Path, fail: bool = False) -> None:
        super().__init__(str(shm), None)
        self._fail = fail

    def stage(self, plan: TablePlan, node: int | None = None) -> StagedSet:
        big = max(range(len(plan.tensors)), key=lambda i: plan.tensors[i].nbytes)
        return _WatchedStage(super().stage(plan, node), big, self._fail)


@pytest.fixture(scope="module")
def one_big_tensor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Engram table of ~20 MB (ten of the loader's pieces) and its small scale table."""
    folder = tmp_path_factory.mktemp("one") / "engram"
    return synthesize(folder, SynthSpec(layers=1, rows=80_000, shards=1))


def test_one_tensor_is_copied_on_several_threads(one_big_tensor: Path) -> None:
    plan = plan_tables(one_big_tensor)
    with mounted_tmpfs("64m") as shm:
        backing = _WatchedTmpfs(shm)
        backing.claim()
        # The first piece's write waits until another thread wrote a later piece:
        # only a loader that splits a tensor over its threads gets past it.
        manifest = load_set(plan, backing, 2, LoadProgress(plan.nbytes))
        folder = sets_root(str(shm)) / manifest.copy
        for entry, t in zip(plan.tensors, manifest.tensors, strict=True):
            with open(entry.file, "rb") as src:
                # One streaming digest per tensor, as verify and adoption recompute it.
                assert t.checksum == digest_fd(src.fileno(), entry.offset, entry.nbytes)
                src.seek(entry.offset)
                assert (folder / t.file).read_bytes()[t.offset :] == src.read(entry.nbytes)


def test_a_failed_piece_fails_the_load_with_its_own_error(one_big_tensor: Path) -> None:
    plan = plan_tables(one_big_tensor)
    with mounted_tmpfs("64m") as shm:
        backing = _WatchedTmpfs(shm, fail=True)
        backing.claim()
        # Threads waiting for the failed piece's turn stop too; the error is the write's.
        with pytest.raises(OSError, match="injected write error"):
            load_set(plan, backing, 2, LoadProgress(plan.nbytes))
        assert list(set_folders(str(shm))) == []


def _load_against_a_filler(d: Daemon, ckpt: Path, shm: Path, n: int) -> str:
    stop = threading.Event()
    path = shm / f"filler-{n}"

    def fill() -> None:
        with open(path, "wb") as out:
            while not stop.is_set():
                try:
                    out.write(b"\2" * (1 << 20))
                    out.flush()
                except OSError:
                    return

    # Alternate who starts first, so both orders of the race happen.
    writer = threading.Thread(target=fill)
    if n % 2:
        writer.start()
    channel, call = start_load(d, ckpt)
    if not n % 2:
        writer.start()
    try:
        for event in call:
            if event.WhichOneof("event") == "attached":
                outcome = "loaded"
                break
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert reason(e) == "capacity" and "--shm-size" in str(e.details())
        outcome = "refused"
    call.cancel()
    channel.close()
    stop.set()
    writer.join()
    path.unlink()
    assert not [p for p in set_folders(shm) if LOADING_MARK in p.name]
    if outcome == "loaded":
        with grpc.insecure_channel(f"unix:{d.socket.with_name('admin.sock')}") as admin:
            [s] = [s for s in d.status().sets if s.checkpoint == str(ckpt)]
            pb_grpc.AdminServiceStub(admin).Drop(pb.DropRequest(set_id=s.set_id), timeout=10)
    return outcome


def test_daemon_killed_while_workers_gather(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    start_workers(workers, 8, checkpoint, d.socket, labels=lambda rank: {"rank": str(rank)})
    for w in workers:
        w.send("lookups 8")
    time.sleep(1)  # the workers are mid-lookup now
    d.stop(signal.SIGKILL)
    d.start()
    assert d.status().sets[0].adopted
    wait_until(lambda: sum(len(s.leases) for s in d.status().sets) == 8, 10, "8 leases back")
    for w in workers:
        result = w.read()
        assert result["bad"] == 0 and result["lookups"] > 0, result
        assert w.exit() == 0


def test_churn_leaves_nothing_behind(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    daemon = psutil.Process(d.pid)
    start_workers(workers, 32, checkpoint, d.socket)
    # A short round first with everyone, so the daemon's pools (asyncio's
    # thread pool grows on demand, up to a bound) reach their working size;
    # a leak is what the long round adds on top.
    for w in workers:
        w.send("churn 3")
    for w in workers:
        w.read()
    before = daemon.num_fds(), daemon.num_threads(), daemon.memory_info().rss
    stop = threading.Event()
    polls = []

    def poll_status() -> None:
        while not stop.is_set():
            polls.append(len(d.status().sets))

    poller = threading.Thread(target=poll_status)
    poller.start()
    for w in workers:
        w.send("churn 30")
    cycles = sum(w.read()["cycles"] for w in workers)
    stop.set()
    poller.join()
    for w in workers:
        assert w.exit() == 0
    wait_until(lambda: sum(len(s.leases) for s in d.status().sets) == 0, 5, "no leases")
    assert cycles > 100 and len(polls) > 10, (cycles, len(polls))
    # Thousands of attaches went through: a leak of anything per attach would
    # show in hundreds. A few may differ: asyncio's thread pool grows on
    # demand up to its bound, and the last connections close asynchronously.
    wait_until(lambda: daemon.num_fds() <= before[0] + 4, 5, f"fds near {before[0]}")
    wait_until(lambda: daemon.num_threads() <= before[1] + 4, 5, f"threads near {before[1]}")
    assert daemon.memory_info().rss - before[2] < 32 << 20, before


def test_checkpoint_changed_on_disk(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path
) -> None:
    ours = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ours)
    d = daemons("--checkpoint", str(ours))
    first = Worker(ours, d.socket)
    workers.append(first)
    assert first.hello["mode"] == "shared"
    # Rewrite a shard in place: same names, shapes and sizes, new values.
    shard = ours / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    for name, t in tensors.items():
        if t.dtype.is_floating_point and t.element_size() == 1:
            tensors[name] = (t.view(torch.uint8) ^ 0x01).view(t.dtype)
    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "pt"})
    auto = Worker(ours, d.socket)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert "changed on disk" in auto.hello["reason"]
    strict = Worker(ours, d.socket, share="on")
    workers.append(strict)
    assert strict.hello["error"] == "FingerprintMismatch"
    digest = hashlib.sha256(tensors["layers.3.engram.embed.weight"].view(torch.uint8).numpy().data)
    assert auto.hello["digests"]["layers.3.engram.embed.weight"] == digest.hexdigest()


def test_verify_on_adoption_drops_a_corrupted_set(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    folder = sets_root(d.shm_dir) / s.set_id
    manifest = json.loads((folder / "manifest.json").read_text())
    victim = manifest["tensors"][0]
    d.stop()
    with open(folder / victim["file"], "r+b") as f:
        os.pwrite(f.fileno(), b"\xff" * 64, victim["offset"])
    d.args.append("--verify")
    d.start()
    [again] = d.status().sets
    assert not again.adopted, "a corrupted set was adopted"
    assert f"tensors {victim['name']} no longer match" in d.log
