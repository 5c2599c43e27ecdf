"""Attacks by local users on a real daemon, each now refused.

Integrity: a planted shm folder, symlinked shards, a file edited in place or
during a load. Exhaustion: selections, descriptors, leases, FIFOs, labels,
fallback reports. Races: drops during pinning, evictions after a restart,
reloads under running workers, unverified pids. Bad paths.
"""

from __future__ import annotations

import contextlib
import grp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import Daemon, Worker, as_user, mounted_tmpfs, wait_until
from engramd.backings import TmpfsBacking
from engramd.backings.handles import HandleKind
from engramd.sets import store as store_module
from engramd.sets.intents import AttachIntent
from engramd.sets.loader import LoadProgress, load_set
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import CheckpointError, UnknownSet
from engramd_shared.headers import SAMPLE_BYTES, SAMPLES
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from engramd_shared.process import pid_namespace, start_ticks
from helpers import (
    InProcessDaemon,
    attach_error,
    in_process_config,
    reason,
    reference_digests,
    set_folders,
)

NOBODY = 65534


def _chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, uid, follow_symlinks=False)


def _engramd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engramd", *args], capture_output=True, text=True, timeout=60
    )


# -- integrity: who may write what workers read --------------------------------


def test_planted_shm_folder_is_moved_aside_and_never_served(
    checkpoint: Path, daemons: Any, workers: list[Worker], shm_dir: Path
) -> None:
    shm_dir.chmod(0o1777)  # like /dev/shm: anyone may create engramd/ first
    # A folder, as any user can plant one (a planted mount needs root: test_huge_default).
    d = daemons("--checkpoint", str(checkpoint), "--no-huge-tmpfs")
    [s] = d.status().sets
    d.stop()
    # Another user owns the folder and a set of altered bytes under the real id.
    root = sets_root(shm_dir)
    tensor = root / s.set_id / "0000.bin"
    with open(tensor, "r+b") as f:
        f.write(b"\xff" * 4096)
    _chown_tree(root, NOBODY)
    d.start()
    assert "another user made it before engramd; moved it aside" in d.log
    [s] = d.status().sets
    assert not s.adopted, "the planted set was adopted"
    assert root.stat().st_uid == os.geteuid() and (root.stat().st_mode & 0o777) == 0o750
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["digests"] == reference_digests(checkpoint)


def test_daemon_user_refuses_a_folder_another_user_made(sock_dir: Path, shm_dir: Path) -> None:
    python = as_user("65533:65533")
    shm_dir.chmod(0o1777)
    os.chown(sock_dir, 65533, 65533)
    root = sets_root(shm_dir)
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    # Its own group as the socket group: whatever groups this machine has (an `engramd`
    # group 65533 is not in, on a deployed node) play no part.
    d = Daemon(
        sock_dir / "d.sock", shm_dir, ["--socket-group", ""], sock_dir / "daemon.log", python=python
    )
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    assert f"rm -rf {root}" in d.log and "owned by uid 65534" in d.log
    root.rmdir()
    d.start()
    try:
        assert root.stat().st_uid == 65533 and (root.stat().st_mode & 0o777) == 0o750
    finally:
        d.stop()


def test_daemon_outside_its_socket_group_names_the_group_and_the_fix(
    sock_dir: Path, shm_dir: Path
) -> None:
    group = "engramd-tg"
    subprocess.run(["groupdel", group], capture_output=True)  # left by an interrupted run
    python = as_user("65533:65533")
    subprocess.run(["groupadd", "--system", group], check=True, capture_output=True)
    try:
        gid = grp.getgrnam(group).gr_gid
        shm_dir.chmod(0o1777)
        os.chown(sock_dir, 65533, 65533)
        args = ["--socket-group", group]
        d = Daemon(sock_dir / "d.sock", shm_dir, args, sock_dir / "daemon.log", python=python)
        with pytest.raises(RuntimeError, match="exited with 1"):
            d.start()
        assert f"not a member of its --socket-group {group!r} (gid {gid})" in d.log
        assert f"usermod -aG {group}" in d.log and "Errno" not in d.log
        assert not sets_root(shm_dir).exists(), "it refused before making anything"
        # The same user with that group is served, and gives the group its socket.
        d = Daemon(
            sock_dir / "d.sock",
            shm_dir,
            args,
            sock_dir / "daemon.log",
            python=as_user(f"65533:{gid}"),
        )
        d.start()
        try:
            assert d.socket.stat().st_gid == gid
        finally:
            d.stop()
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


@pytest.mark.parametrize("handles", ["fd", "shm"])
def test_nobody_maps_a_set_folder_that_is_not_the_daemons(
    checkpoint: Path,
    daemons: Any,
    workers: list[Worker],
    handles: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # By descriptor the daemon refuses to open the planted files; by path the worker does.
    monkeypatch.setenv("ENGRAMD_HANDLES", handles)
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    folder = sets_root(d.shm_dir) / s.set_id
    # What only root could do now: put someone else's copy in the set's place.
    os.rename(folder, folder.with_name("moved"))
    shutil.copytree(folder.with_name("moved"), folder)
    _chown_tree(folder, NOBODY)
    strict = Worker(checkpoint, d.socket, share="on")
    workers.append(strict)
    assert strict.hello["error"] == "SegmentNotVisible"
    assert "not engramd's own" in strict.hello["message"] and "65534" in strict.hello["message"]


def _copy_with_links(checkpoint: Path, folder: Path, target: Path) -> None:
    """`folder` with the checkpoint's index, its shards symlinks to copies in `target`."""
    shutil.copytree(checkpoint, target)
    folder.mkdir(parents=True)
    for f in checkpoint.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(target / f.name)
        else:
            shutil.copy(f, folder / f.name)


def test_symlinked_shards_must_resolve_inside_the_root(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    _copy_with_links(checkpoint, root / "evil", tmp_path / "elsewhere")
    # The way a Hugging Face cache links snapshots to blobs, inside the root.
    _copy_with_links(checkpoint, root / "hub" / "snapshot", root / "hub" / "blobs")
    d = daemons("--allow-root", str(root))
    set_id = plan_tables(checkpoint).set_id
    err = attach_error(d, pb.AttachRequest(set_id=set_id, checkpoint=str(root / "evil")))
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "outside the allowed root" in str(err.details())
    # A differing checkpoint is refused without telling the caller the daemon's set id.
    other = "f" * 20
    err = attach_error(d, pb.AttachRequest(set_id=other, checkpoint=str(root / "hub/snapshot")))
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert set_id not in str(err.details())
    assert d.status().sets == []
    hub = pb.AttachRequest(set_id=set_id, checkpoint=str(root / "hub" / "snapshot"))
    assert attach_error(d, hub) is None


def _edit_a_row_the_samples_miss(shard: Path) -> None:
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        span = size - start - SAMPLE_BYTES
        # Halfway between the 4th and 5th samples: far from every sampled block.
        offset = start + span * (2 * (SAMPLES // 2) - 1) // (2 * (SAMPLES - 1))
        f.seek(offset)
        row = f.read(264)
        f.seek(offset)
        f.write(bytes(b ^ 0x5A for b in row))


def test_row_edited_in_place_is_never_served_as_the_old_bytes(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path
) -> None:
    ours = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ours)
    d = daemons("--checkpoint", str(ours))
    set_id = plan_tables(ours).set_id
    _edit_a_row_the_samples_miss(ours / "model-00002-of-00002.safetensors")
    assert plan_tables(ours).set_id == set_id, "the edit should keep the set id"
    strict = Worker(ours, d.socket, share="on")
    workers.append(strict)
    assert strict.hello["error"] == "FingerprintMismatch"
    assert "changed on disk after engramd loaded it" in strict.hello["message"]
    auto = Worker(ours, d.socket)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert auto.hello["digests"] == reference_digests(ours)


def test_file_changed_before_or_during_a_load_is_not_published(
    checkpoint: Path, tmp_path: Path, shm_dir: Path
) -> None:
    ours = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ours)
    backing = TmpfsBacking(str(shm_dir), None)
    backing.claim()
    plan = plan_tables(ours)
    shard = plan.sources[-1].path

    class WriterDuringTheCopy(LoadProgress):
        def add(self, n: int, source: str = "") -> None:
            os.utime(shard)  # what any write does: a new mtime and ctime
            super().add(n, source)

    with pytest.raises(CheckpointError, match="changed during the load"):
        load_set(plan, backing, 2, WriterDuringTheCopy(plan.nbytes))
    assert list(set_folders(shm_dir)) == []
    with pytest.raises(CheckpointError, match="changed since its headers were read"):
        load_set(plan, backing, 2, LoadProgress(plan.nbytes))
    assert list(set_folders(shm_dir)) == []
    fresh = plan_tables(ours)
    manifest = load_set(fresh, backing, 2, LoadProgress(fresh.nbytes))
    assert manifest.sources == fresh.sources


# -- exhaustion: one member of the group must not take the node down -------------


def test_workers_load_only_the_configured_selection(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    inside = tmp_path / "ckpt"
    shutil.copytree(checkpoint, inside)
    d = daemons("--allow-root", str(tmp_path))
    for glob in ("*", "*weight", "*scale", "layers.1.*", "layers.3.*", "*engram*", "*.embed.*"):
        request = pb.AttachRequest(
            set_id=plan_tables(inside, glob).set_id, checkpoint=str(inside), tensors=glob
        )
        err = attach_error(d, request)
        assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, glob
        assert reason(err) == "selection" and "--tensors" in str(err.details())
    assert d.status().sets == []
    plan = plan_tables(inside)
    request = pb.AttachRequest(set_id=plan.set_id, checkpoint=str(inside), tensors=plan.selection)
    assert attach_error(d, request) is None
    assert len(d.status().sets) == 1


def test_a_thousand_idle_connections_leave_room(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"this test needs 1200 descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The soft limit most services start with; the daemon raises it to the hard one.
    d = daemons(
        "--checkpoint",
        str(checkpoint),
        python=["prlimit", "--nofile=1024:8192", sys.executable],
    )
    limits = Path(f"/proc/{d.pid}/limits").read_text()
    assert re.search(r"Max open files\s+8192\s+8192", limits), limits
    idle = []
    try:
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.socket))
            idle.append(s)
        assert _engramd("status", "--socket", str(d.socket)).returncode == 0
        w = Worker(checkpoint, d.socket, share="on")
        workers.append(w)
        assert w.hello["mode"] == "shared"
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_leases_are_bounded(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--max-leases", "2")
    for _ in range(2):
        workers.append(Worker(checkpoint, d.socket, share="on"))
        assert workers[-1].hello["mode"] == "shared"
    third = Worker(checkpoint, d.socket, share="on")
    workers.append(third)
    assert third.hello["error"] == "TooManyLeases" and "--max-leases" in third.hello["message"]
    auto = Worker(checkpoint, d.socket)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert d.status().sets[0].lease_count == 2


def test_fifo_shards_are_refused_at_once(
    checkpoint: Path, daemons: Any, open_dirs: tuple[Path, Path, Path]
) -> None:
    # A folder any member may list: a FIFO there is no secret, and the error names it.
    root = open_dirs[0] / "root"
    for i in range(12):  # more than every pool has threads
        (root / f"fifo{i}").mkdir(parents=True)
        os.mkfifo(root / f"fifo{i}" / "a.safetensors")
    shutil.copytree(checkpoint, root / "good")
    d = daemons("--allow-root", str(root))
    for i in range(12):
        err = attach_error(d, pb.AttachRequest(set_id="0" * 20, checkpoint=str(root / f"fifo{i}")))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a regular file" in str(err.details())
    good = pb.AttachRequest(set_id=plan_tables(checkpoint).set_id, checkpoint=str(root / "good"))
    assert attach_error(d, good) is None
    assert d.stop() == 0


def test_shutdown_ends_within_its_grace_whatever_a_reader_does(
    sock_dir: Path, shm_dir: Path
) -> None:
    fifo = sock_dir / "hung"
    os.mkfifo(fifo)  # opened blocking and never written: a read stuck like one on a hung NFS
    script = textwrap.dedent(f"""
        import asyncio, threading
        from engramd.config import DaemonConfig
        from engramd.lifecycle import create_server

        async def main():
            server = create_server(DaemonConfig(
                socket={str(sock_dir / "d.sock")!r}, shm_dir={str(shm_dir)!r},
                socket_group="", mlock=False, grace=1.0))
            await server.startup()
            reading = threading.Event()
            def stuck():
                reading.set()
                with open({str(fifo)!r}, "rb") as f:
                    f.read()
            task = asyncio.ensure_future(server.sets.readers.run(stuck))
            await asyncio.to_thread(reading.wait)
            print("stuck", flush=True)
            await server.shutdown()
            print("stopped", flush=True)

        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert proc.returncode == 0 and out.split() == ["stuck", "stopped"]
    assert not (sock_dir / "d.sock").exists() and not (sock_dir / "admin.sock").exists()


def test_labels_are_bounded_and_status_stays_small(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    set_id = d.status().sets[0].set_id
    for labels in (
        {f"k{i}": "v" for i in range(17)},
        {"rank": "0\nlease forged  pid 1"},
        {"rank": "x" * 64},
        {"": "empty key"},
    ):
        err = attach_error(d, pb.AttachRequest(set_id=set_id, labels=labels))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, labels
    big = {f"{i:02d}" + "k" * 61: "v" * 63 for i in range(16)}
    with d.channel() as ch:
        stub = pb_grpc.TableServiceStub(ch)
        calls = [
            stub.Attach(pb.AttachRequest(set_id=set_id, pid=os.getpid(), labels=big), timeout=60)
            for _ in range(100)
        ]
        try:
            for call in calls:
                assert next(iter(call)).WhichOneof("event") == "attached"
            result = _engramd("status", "--socket", str(d.socket), "--json")
            assert result.returncode == 0, result.stderr
            assert '"lease_count": 100' in result.stdout
            text = _engramd("status", "--socket", str(d.socket)).stdout
            rows = [line for line in text.splitlines() if f"  {os.getpid()}  " in line]
            assert len(rows) == 64 and "and 36 more leases" in text
        finally:
            for call in calls:
                call.cancel()


def test_paths_and_causes_from_workers_print_on_one_line(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    evil = tmp_path / "root" / "x\n    lease forged  pid 1"
    shutil.copytree(checkpoint, evil)
    d = daemons("--allow-root", str(tmp_path / "root"))
    assert (
        attach_error(d, pb.AttachRequest(set_id=plan_tables(evil).set_id, checkpoint=str(evil)))
        is None
    )
    # As the owner sees it (the admin socket): the worker socket withholds a
    # worker-loaded set's path.
    text = _engramd("status", "--socket", str(d.socket)).stdout
    assert "\\x0a    lease forged" in text
    assert not any(line.startswith("    lease forged") for line in text.splitlines())
    with d.channel() as ch:
        stub = pb_grpc.TableServiceStub(ch)
        for i in range(20):
            with pytest.raises(grpc.RpcError) as info:
                stub.ReportFallback(pb.FallbackReport(cause=f"bogus{i}\nforged"), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.ReportFallback(pb.FallbackReport(cause="capacity"), timeout=5)
    assert not any(
        line.lstrip().startswith(("lease forged", "forged")) for line in d.log.splitlines()
    )
    assert "fell back to private tables (capacity" in d.log


# -- races and lifecycle ----------------------------------------------------------


def _vmlck_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmLck:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]


def test_drop_right_after_ready_leaves_nothing_locked(daemons: Any, tmp_path: Path) -> None:
    ckpt = synthesize(tmp_path / "big", SynthSpec(rows=250_000))  # ~132 MB to pin
    d = daemons("--allow-root", str(tmp_path))
    loaded = _engramd("load", str(ckpt), "--socket", str(d.socket))
    assert loaded.returncode == 0, loaded.stderr
    set_id = loaded.stdout.split()[1]
    dropped = _engramd("drop", set_id, "--socket", str(d.socket))
    assert dropped.returncode == 0, dropped.stderr
    wait_until(lambda: _vmlck_kib(d.pid) == 0, 30, "the daemon to unlock the dropped set")
    assert "Traceback" not in d.log and "never retrieved" not in d.log


def test_adopted_sets_are_not_evicted_while_workers_reattach(
    tmp_path: Path, daemons: Any, workers: list[Worker]
) -> None:
    one = synthesize(tmp_path / "one", SynthSpec(rows=20_000, seed=1))
    two = synthesize(tmp_path / "two", SynthSpec(rows=20_000, seed=2))
    budget = str(int(1.5 * plan_tables(one).nbytes))
    d = daemons(
        "--allow-root",
        str(tmp_path),
        "--memory-budget",
        budget,
        "--evict-idle",
        "--adopt-grace",
        "600",
    )
    w = Worker(one, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    w.proc.send_signal(signal.SIGSTOP)  # it cannot re-attach until it is continued
    try:
        d.stop()
        d.start()
        [adopted] = d.status().sets
        assert adopted.adopted and adopted.lease_count == 0
        err = attach_error(d, pb.AttachRequest(set_id=plan_tables(two).set_id, checkpoint=str(two)))
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--adopt-grace" in str(err.details())
        assert [s.set_id for s in d.status().sets] == [adopted.set_id]
    finally:
        w.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: d.status().sets[0].lease_count == 1, 10, "the worker to re-attach")
    assert w.ask("digest")["digests"] == reference_digests(one)


def test_a_reload_reaches_running_workers(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    [s] = d.status().sets
    assert _engramd("drop", s.set_id, "--force", "--socket", str(d.socket)).returncode == 0
    assert _engramd("load", str(checkpoint), "--socket", str(d.socket)).returncode == 0

    def stale_lease() -> bool:
        leases = d.status().sets[0].leases
        return len(leases) == 1 and leases[0].stale

    wait_until(stale_lease, 10, "the worker's lease back, marked stale")
    # The worker's lease thread reads the same attachment; wait for it, not for a sleep.
    wait_until(lambda: w.ask("lease")["stale"] is True, 10, "the worker to see its copy stale")
    fresh = w.ask("refresh")
    assert fresh["stale"] is False
    wait_until(
        lambda: [x.stale for x in d.status().sets[0].leases] == [False], 10, "one fresh lease"
    )
    assert w.ask("digest")["digests"] == reference_digests(checkpoint)
    assert w.exit() == 0
    assert "Tables.refresh()" in w.stderr()


def test_refused_load_evicts_nothing(
    checkpoint: Path, daemons: Any, tmp_path: Path, sock_dir: Path
) -> None:
    big = synthesize(tmp_path / "big", SynthSpec(rows=200_000))  # more than the tmpfs holds
    inside = tmp_path / "small"
    shutil.copytree(checkpoint, inside)
    # Within the budget only once the small set is evicted; beyond the tmpfs either way.
    budget = str(plan_tables(big).nbytes + plan_tables(inside).nbytes // 2)
    with mounted_tmpfs("64m") as shm:
        args = ["--allow-root", str(tmp_path), "--memory-budget", budget, "--evict-idle"]
        args += ["--adopt-grace", "0"]
        d = Daemon(sock_dir / "d.sock", shm, args, sock_dir / "daemon.log").start()
        try:
            small = pb.AttachRequest(set_id=plan_tables(inside).set_id, checkpoint=str(inside))
            assert attach_error(d, small) is None
            err = attach_error(
                d, pb.AttachRequest(set_id=plan_tables(big).set_id, checkpoint=str(big))
            )
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert [s.set_id for s in d.status().sets] == [small.set_id]
            assert "evicting" not in d.log
        finally:
            d.stop()


def test_pids_are_judged_only_where_they_match_and_never_shown_verified(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--sweep-interval", "0.05")
    set_id = d.status().sets[0].set_id
    claimed = subprocess.Popen(["sleep", "600"])  # stands for a pid in another namespace
    matched = subprocess.Popen(["sleep", "600"])

    def claim(pid: int) -> dict[str, Any]:
        return {"pid": pid, "pid_namespace": pid_namespace(), "pid_start": start_ticks(pid) or 0}

    requests = [
        pb.AttachRequest(set_id=set_id, pid=claimed.pid, labels={"who": "claimed"}),
        # pid 1's namespace and start time: a claim anyone can make.
        pb.AttachRequest(set_id=set_id, labels={"who": "init"}, **claim(1)),
        pb.AttachRequest(set_id=set_id, labels={"who": "matched"}, **claim(matched.pid)),
    ]
    with d.channel() as ch:
        stub = pb_grpc.TableServiceStub(ch)
        calls = [stub.Attach(r, timeout=60) for r in requests]
        try:
            for call in calls:
                assert next(iter(call)).WhichOneof("event") == "attached"

            def leases() -> dict[str, bool]:
                return {x.labels["who"]: x.pid_verified for x in d.status().sets[0].leases}

            # Only the kernel verifies a pid (the fd channel); a request only claims one.
            assert leases() == {"claimed": False, "init": False, "matched": False}
            for p in (claimed, matched):
                p.kill()
                p.wait()
            # A claim that matched a process here ends with it (at worst, the claimer's lease).
            wait_until(lambda: "matched" not in leases(), 10, "the sweep to end the lease")
            # That sweep ran after both processes were gone: the unmatched pid was not judged.
            assert leases() == {"claimed": False, "init": False}
        finally:
            for call in calls:
                call.cancel()


# -- bad paths ------------------------------------------------------------------------


def test_bad_paths_get_a_status_code_not_a_traceback(daemons: Any, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "shards").mkdir(parents=True)
    (root / "loop").symlink_to(root / "loop")
    (root / "shards" / "a.safetensors").symlink_to(root / "shards" / "a.safetensors")
    d = daemons("--allow-root", str(root))
    for path in (f"{root}/bad\0name", str(root / "loop"), str(root / "shards")):
        err = attach_error(d, pb.AttachRequest(set_id="0" * 20, checkpoint=path))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, path
    assert "internal error" not in d.log and "Traceback" not in d.log


@contextlib.contextmanager
def _in_process(checkpoint: Path, sock_dir: Path, shm_dir: Path) -> Iterator[InProcessDaemon]:
    """An in-process daemon holding the checkpoint's set, once that set is ready."""
    config = in_process_config(sock_dir, shm_dir, checkpoints=[str(checkpoint)])
    with InProcessDaemon(config) as d:
        wait_until(lambda: d.server.store.ready, 30, "the configured set")
        yield d


def _paused(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[threading.Event, threading.Event]:
    """Replace engramd.sets.store's `name` by one that waits for the test; (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(store_module, name)

    def paused(*args: Any) -> Any:
        entered.set()
        assert release.wait(60), "the test never released the pause"
        return real(*args)

    monkeypatch.setattr(store_module, name, paused)
    return entered, release


def test_a_drop_in_progress_does_not_stall_the_daemon(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = _paused(monkeypatch, "_remove")
    with _in_process(checkpoint, sock_dir, shm_dir) as d:
        [(set_id, backing, node)] = [ts.key for ts in d.server.store.sets.all()]
        assert (backing, node) == ("tmpfs", None)
        drop = d.spawn(d.server.store.drop(set_id, force=False))
        assert entered.wait(30)
        # The unlink is paused on its thread: status and attaches still answer.
        with grpc.insecure_channel(f"unix:{sock_dir / 'd.sock'}") as ch:
            reply = pb_grpc.TableServiceStub(ch).Status(pb.StatusRequest(), timeout=10)
        assert [s.set_id for s in reply.sets] == []
        assert (sets_root(shm_dir) / set_id).exists()
        release.set()
        assert drop.result(30)[1] == 0
        assert not (sets_root(shm_dir) / set_id).exists()


def test_verify_racing_a_drop_answers_not_found(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = _paused(monkeypatch, "_corrupted")
    with _in_process(checkpoint, sock_dir, shm_dir) as d:
        [(set_id, backing, node)] = [ts.key for ts in d.server.store.sets.all()]
        assert (backing, node) == ("tmpfs", None)
        with grpc.insecure_channel(f"unix:{sock_dir / 'admin.sock'}") as ch:
            admin = pb_grpc.AdminServiceStub(ch)
            verify = admin.Verify.future(pb.VerifyRequest(set_id=set_id), timeout=30)
            assert entered.wait(30)
            admin.Drop(pb.DropRequest(set_id=set_id), timeout=30)
            release.set()
            with pytest.raises(grpc.RpcError) as info:
                verify.result()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "dropped while it was being verified" in str(info.value.details())


def test_no_lease_on_a_set_that_left_the_store(
    checkpoint: Path, sock_dir: Path, shm_dir: Path
) -> None:
    with _in_process(checkpoint, sock_dir, shm_dir) as d:
        [ts] = d.server.store.sets.all()
        d.run(d.server.store.drop(ts.set_id, force=False))
        # An attach that waited while the set was evicted must not lease it.
        with pytest.raises(UnknownSet, match="dropped while the worker waited"):
            d.server.store.leases.add(
                ts, AttachIntent(set_id=ts.set_id, pid=os.getpid()), HandleKind.FD
            )


def test_a_kept_plan_is_handed_out_while_every_checkpoint_reader_is_taken(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engramd.sets import keeper as keeper_module
    from engramd.sets import plans as plans_module

    # One member's checkpoints on a mount that hangs (which cannot exist here: a read
    # that waits for the test stands in for it) take every reader of checkpoints.
    readers = keeper_module.CHECKPOINT_READERS
    small = synthesize(tmp_path / "small", SynthSpec(rows=2000))
    root = tmp_path / "root"
    for i in range(readers):
        shutil.copytree(small, root / f"hung{i}")
    entered = threading.Semaphore(0)
    release = threading.Event()
    real = plans_module.plan_tables

    def hung(path: Path, *args: Any) -> Any:
        if path.name.startswith("hung"):
            entered.release()
            assert release.wait(60), "the test never released the hung reads"
        return real(path, *args)

    monkeypatch.setattr(plans_module, "plan_tables", hung)
    config = in_process_config(
        sock_dir, shm_dir, checkpoints=[str(checkpoint)], allow_roots=[str(root)]
    )
    with InProcessDaemon(config) as d, grpc.insecure_channel(f"unix:{sock_dir / 'd.sock'}") as ch:
        wait_until(lambda: d.server.store.ready, 30, "the configured set")
        stub = pb_grpc.TableServiceStub(ch)
        stuck = [
            stub.Attach(
                pb.AttachRequest(set_id="0" * 20, checkpoint=str(root / f"hung{i}"), pid=1),
                timeout=60,
            )
            for i in range(readers)
        ]
        try:
            for _ in range(readers):
                assert entered.acquire(timeout=30), "the hung reads did not start"
            # A worker of the configured checkpoint: its plan is kept, and checked on
            # threads of its own, not behind the readers.
            request = pb.AttachRequest(
                set_id=plan_tables(checkpoint).set_id,
                checkpoint=str(checkpoint),
                pid=os.getpid(),
                accept=[pb.HANDLE_KIND_FD],
            )
            call = stub.Attach(request, timeout=10)
            try:
                assert next(iter(call)).WhichOneof("event") == "attached"
            finally:
                call.cancel()
        finally:
            release.set()
            for c in stuck:
                c.cancel()
