"""A set is served for a checkpoint only for files proven to hold its bytes.

Two unprivileged users share one daemon (socket group, --allow-root): one
plants altered bytes under a public checkpoint's set id, the other attaches
its own clean copy; one forges a twin that keeps every XXH3 checksum, which
the operator then loads or configures. And a checkpoint on tmpfs written in
place through a shared mapping, which changes neither its mtime nor its ctime.
"""

from __future__ import annotations

import grp
import json
import mmap
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from xxh3_forge import forge

from conftest import SUPPORT, Daemon, Worker, as_user, mounted_tmpfs, wait_until
from engramd.host.hugeroot import remove_shm_folder
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.headers import SAMPLE_BYTES, SAMPLES
from engramd_shared.layout import MANIFEST_NAME, sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import attach_error, bytes_read, engramd, reason, reference_digests

GROUP = "engramd-tp"
ALICE = 60151
BOB = 60152
SHARD = "model-00002-of-00002.safetensors"


def _edit_between_samples(shard: Path) -> None:
    """Change 4 KiB of data that no fingerprint sample reads (the set id stays)."""
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        span = size - start - SAMPLE_BYTES
        # Halfway between the 4th and 5th samples: far from every sampled block.
        offset = start + span * (2 * (SAMPLES // 2) - 1) // (2 * (SAMPLES - 1))
        with mmap.mmap(f.fileno(), 0) as m:
            m[offset : offset + 4096] = bytes(b ^ 0x5A for b in m[offset : offset + 4096])


def _own(path: Path, uid: int, gid: int, mode: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, gid)
        p.chmod(mode if p.is_dir() else mode & 0o666)


@dataclass
class Node:
    """A daemon serving a socket group, with a folder per user under its allowed root."""

    daemon: Daemon
    gid: int
    root: Path

    def user(self, uid: int) -> str:
        """run_as.py's spec for `uid` in the socket group only."""
        return f"{uid}:{self.gid}"

    def copy_for(self, uid: int, name: str, checkpoint: Path) -> Path:
        """A private copy of `checkpoint` owned by `uid` (mode 0700: no one else may read it)."""
        folder = self.root / f"{uid}" / name
        shutil.copytree(checkpoint, folder)
        _own(self.root / f"{uid}", uid, self.gid, 0o700)
        return folder


@pytest.fixture
def node(checkpoint: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    """The daemon, with the serve flags a test gives (indirect parametrization) added."""
    if os.geteuid() != 0:
        pytest.skip("creating a group and dropping to other users needs root")
    subprocess.run(["groupdel", GROUP], capture_output=True)  # left by an interrupted run
    subprocess.run(["groupadd", "--system", GROUP], check=True, capture_output=True)
    top = Path(tempfile.mkdtemp(prefix="edp", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="engramd-test-proof", dir="/dev/shm"))
    root = top / "root"
    root.mkdir()
    for p in (top, shm, root):
        p.chmod(0o755)
    d = Daemon(
        top / "run" / "d.sock",
        shm,
        ["--allow-root", str(root), "--socket-group", GROUP, *getattr(request, "param", [])],
        top / "log",
    ).start()
    try:
        yield Node(d, grp.getgrnam(GROUP).gr_gid, root)
    finally:
        d.stop()
        shutil.rmtree(top, ignore_errors=True)
        remove_shm_folder(shm)
        subprocess.run(["groupdel", GROUP], capture_output=True)


def test_planted_bytes_reach_no_other_copy(
    node: Node, checkpoint: Path, workers: list[Worker]
) -> None:
    d = node.daemon
    poisoned = node.copy_for(ALICE, "poisoned", checkpoint)
    _edit_between_samples(poisoned / SHARD)
    assert plan_tables(poisoned).set_id == plan_tables(checkpoint).set_id
    clean = reference_digests(checkpoint)
    planted = reference_digests(poisoned)
    assert planted != clean

    alice = Worker(poisoned, d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    assert alice.hello["digests"] == planted

    # Bob's own clean copy, same set id: never served Alice's bytes, and not shut out
    # by them either: his files get a set of their own.
    mine = node.copy_for(BOB, "clean", checkpoint)
    strict = Worker(mine, d.socket, share="on", user=node.user(BOB))
    workers.append(strict)
    assert strict.hello["mode"] == "shared", strict.hello
    assert strict.hello["digests"] == clean
    assert strict.hello["set_id"] != alice.hello["set_id"]
    auto = Worker(mine, d.socket, user=node.user(BOB))
    workers.append(auto)
    assert auto.hello["mode"] == "shared", auto.hello
    assert auto.hello["digests"] == clean and auto.hello["set_id"] == strict.hello["set_id"]
    # Nor by the bare set id: Alice's attach loaded it, the operator did not.
    by_id = Worker(plan_tables(checkpoint).set_id, d.socket, share="on", user=node.user(BOB))
    workers.append(by_id)
    assert by_id.hello["error"] == "UnknownSet", by_id.hello

    # A copy holding the very same bytes is proven by its digest and shared.
    same = node.copy_for(BOB, "same", poisoned)
    twin = Worker(same, d.socket, share="on", user=node.user(BOB))
    workers.append(twin)
    assert twin.hello["mode"] == "shared", twin.hello
    assert twin.hello["digests"] == planted
    # Meanwhile the daemon served everyone: Alice's set (her lease and the twin's), and
    # Bob's clean one (his two workers').
    leases = {s.set_id: s.lease_count for s in d.status().sets}
    assert leases == {alice.hello["set_id"]: 2, strict.hello["set_id"]: 2}
    again = Worker(poisoned, d.socket, share="on", user=node.user(ALICE))
    workers.append(again)
    assert again.hello["mode"] == "shared"
    # The operator loading the clean checkpoint does not publish Alice's set under its id.
    admin = f"unix:{d.socket.with_name('admin.sock')}"
    with grpc.insecure_channel(admin) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.AdminServiceStub(channel).Load(pb.LoadRequest(checkpoint=str(mine))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    late = Worker(plan_tables(checkpoint).set_id, d.socket, share="on", user=node.user(BOB))
    workers.append(late)
    assert late.hello["error"] == "UnknownSet", late.hello


def _attach_events(d: Daemon, request: pb.AttachRequest) -> list[pb.AttachEvent]:
    """The attach's events up to the attachment (the lease ends with the stream)."""
    events = []
    with d.channel() as ch:
        stream = pb_grpc.TableServiceStub(ch).Attach(request, timeout=60)
        for event in stream:
            events.append(event)
            if event.HasField("attached"):
                break
        stream.cancel()
    return events


def test_a_copy_is_digested_once_with_progress_inside_the_roots_only(
    checkpoint: Path, daemons: Any, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(checkpoint, root / "a")
    d = daemons("--allow-root", str(root))
    set_id = plan_tables(checkpoint).set_id
    assert attach_error(d, pb.AttachRequest(set_id=set_id, checkpoint=str(root / "a"))) is None
    [s] = d.status().sets
    # The same bytes outside the allowed root: the daemon may not read them to compare.
    err = attach_error(d, pb.AttachRequest(set_id=set_id, checkpoint=str(checkpoint)))
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason(err) == "not-allowed"
    # Inside it, a second copy is digested, with progress, then served...
    shutil.copytree(checkpoint, root / "b")
    request = pb.AttachRequest(
        set_id=set_id, checkpoint=str(root / "b"), accept=[pb.HANDLE_KIND_FD]
    )
    assert d.proc is not None
    before = bytes_read(d.proc.pid)
    events = _attach_events(d, request)
    assert events[-1].attached.set_id == set_id
    assert [e.progress.bytes_total for e in events[:-1]] == [s.bytes] * (len(events) - 1) != []
    assert bytes_read(d.proc.pid) - before >= s.bytes
    # ... once: its digests are kept for its files' identity.
    before = bytes_read(d.proc.pid)
    events = _attach_events(d, request)
    assert len(events) == 1 and events[0].attached.set_id == set_id
    assert bytes_read(d.proc.pid) - before < s.bytes // 10
    assert [x.set_id for x in d.status().sets] == [set_id]


def test_tmpfs_checkpoint_written_through_a_mapping_is_not_served(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    with mounted_tmpfs("64m") as mount:
        ckpt = mount / "engram"
        shutil.copytree(checkpoint, ckpt)
        d = daemons("--checkpoint", str(ckpt))
        first = Worker(ckpt, d.socket, share="on")
        workers.append(first)
        assert first.hello["mode"] == "shared"
        assert first.hello["digests"] == reference_digests(checkpoint)

        shard = ckpt / SHARD
        before = shard.stat()
        _edit_between_samples(shard)
        after = shard.stat()
        # What makes tmpfs different: the kernel stamps no time on such a write.
        assert (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)
        assert plan_tables(ckpt).set_id == plan_tables(checkpoint).set_id

        strict = Worker(ckpt, d.socket, share="on")
        workers.append(strict)
        assert strict.hello["error"] == "FingerprintMismatch", strict.hello
        auto = Worker(ckpt, d.socket)
        workers.append(auto)
        assert auto.hello["mode"] == "private"
        assert auto.hello["digests"] == reference_digests(ckpt)
        # The first worker keeps its mapping; the daemon keeps serving the set.
        assert first.ask("digest") == {"digests": reference_digests(checkpoint)}
        [s] = d.status().sets
        assert s.state == "ready" and s.lease_count == 1
        for w in workers:
            w.kill()


def _read_by_attach(d: Daemon, ckpt: Path, workers: list[Worker]) -> int:
    assert d.proc is not None
    before = bytes_read(d.proc.pid)
    w = Worker(ckpt, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    return bytes_read(d.proc.pid) - before


def test_tmpfs_checkpoints_are_digested_at_each_attach(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    with mounted_tmpfs("64m") as mount:
        ckpt = mount / "engram"
        shutil.copytree(checkpoint, ckpt)
        d = daemons("--checkpoint", str(ckpt))
        [s] = d.status().sets
        for _ in range(2):
            assert _read_by_attach(d, ckpt, workers) >= s.bytes
        for w in workers:
            w.kill()


def test_disk_checkpoints_are_proven_by_identity(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    disk = daemons("--checkpoint", str(checkpoint))
    [s] = disk.status().sets
    # The set's own files on a filesystem that stamps every write: headers and samples only.
    assert _read_by_attach(disk, checkpoint, workers) < s.bytes // 10


def test_status_shows_the_group_only_what_all_of_it_may_read(
    node: Node, checkpoint: Path, workers: list[Worker], tmp_path: Path
) -> None:
    d = node.daemon
    private = node.copy_for(ALICE, "private", checkpoint)
    alice = Worker(private, d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared"
    public = node.root / "public"
    synthesize(public, SynthSpec(rows=4000))
    for p in (public, *public.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    bob = Worker(public, d.socket, share="on", user=node.user(BOB))
    workers.append(bob)
    assert bob.hello["mode"] == "shared"

    seen = subprocess.run(
        [*as_user(node.user(BOB)), "-m", "engramd", "status", "--json", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen.returncode == 0, seen.stderr
    sets = {s["set_id"]: s for s in json.loads(seen.stdout)["sets"]}
    # Bob sees that a set of Alice's size exists, not its id, path or leases.
    assert set(sets) == {"", bob.hello["set_id"]}
    assert sets[""]["checkpoint"] == "" and sets[""]["leases"] == []
    assert sets[""]["bytes"] > 0 and str(private) not in seen.stdout
    assert alice.hello["set_id"] not in seen.stdout
    assert sets[bob.hello["set_id"]]["checkpoint"] == str(public)
    # The owner's admin socket shows both.
    assert {s.set_id for s in d.status().sets} == {alice.hello["set_id"], bob.hello["set_id"]}


def test_a_restart_configured_for_the_clean_copy_does_not_publish_planted_bytes(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(checkpoint, root / "planted")
    _edit_between_samples(root / "planted" / SHARD)
    d = daemons("--allow-root", str(root))
    w = Worker(root / "planted", d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    w.kill()
    d.stop()
    # The next daemon adopts the planted set, and is configured for the clean checkpoint.
    d.args = ["--checkpoint", str(checkpoint)]
    d.start(wait="up")
    assert f"cannot load configured checkpoint {checkpoint}" in d.log
    assert "does not hold the bytes" in d.log
    assert not d.status().daemon.ready
    by_id = Worker(plan_tables(checkpoint).set_id, d.socket, share="on")
    workers.append(by_id)
    assert by_id.hello["error"] == "UnknownSet", by_id.hello
    clean = Worker(checkpoint, d.socket)
    workers.append(clean)
    assert clean.hello["mode"] == "private"
    assert clean.hello["digests"] == reference_digests(checkpoint)


def _as(node: Node, uid: int, *args: str) -> dict[str, Any]:
    """Run a tests/ script as `uid` of the socket group; its one JSON line."""
    ran = subprocess.run(
        [*as_user(node.user(uid)), *args], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    result: dict[str, Any] = json.loads(ran.stdout)
    return result


def test_a_set_a_worker_loaded_goes_only_to_uids_that_may_read_its_checkpoint(
    node: Node, checkpoint: Path, workers: list[Worker]
) -> None:
    d = node.daemon
    private = node.copy_for(ALICE, "private", checkpoint)
    alice = Worker(private, d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    set_id = alice.hello["set_id"]

    # Its files are the daemon's alone: a member can list the folder (names), not read bytes.
    folder = next(p for p in sets_root(d.shm_dir).iterdir() if p.name.startswith(set_id))
    data = sorted(folder.iterdir())
    assert MANIFEST_NAME in [f.name for f in data]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in data)
    seen = _as(node, BOB, str(SUPPORT / "shm_peek.py"), str(sets_root(d.shm_dir)), str(data[0]))
    assert folder.name in seen["names"] and seen["read"] is False

    # Bob names Alice's folder (which he cannot read) with the set's id: the daemon
    # knows the files, but the fd channel sees Bob's uid and hands out nothing.
    refused = _as(node, BOB, str(SUPPORT / "lease_probe.py"), str(d.socket), set_id, str(private))
    assert refused["error"] == "NotAllowed", refused
    assert f"uid {BOB} may not read the checkpoint files" in refused["message"]
    # Nor by path, whoever asks: the gRPC socket cannot tell.
    by_path = pb.AttachRequest(set_id=set_id, checkpoint=str(private), accept=[pb.HANDLE_KIND_SHM])
    err = attach_error(d.socket, by_path)
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason(err) == "not-allowed" and "never by path" in (err.details() or "")

    # Meanwhile Bob's own copy of the same bytes is proven and served to him.
    mine = node.copy_for(BOB, "mine", checkpoint)
    bob = Worker(mine, d.socket, share="on", user=node.user(BOB))
    workers.append(bob)
    assert bob.hello["mode"] == "shared", bob.hello
    assert bob.hello["set_id"] == set_id and bob.hello["digests"] == reference_digests(checkpoint)
    granted = _as(node, BOB, str(SUPPORT / "lease_probe.py"), str(d.socket), set_id, str(mine))
    assert granted["files"], granted

    # A worker that takes paths only is refused clearly, and goes private in auto mode.
    paths = ["env", "ENGRAMD_HANDLES=shm"]
    strict = Worker(private, d.socket, share="on", user=node.user(ALICE), prefix=paths)
    workers.append(strict)
    assert strict.hello["error"] == "NotAllowed", strict.hello
    assert "only as descriptors" in strict.hello["message"]
    auto = Worker(private, d.socket, user=node.user(ALICE), prefix=paths)
    workers.append(auto)
    assert auto.hello["mode"] == "private", auto.hello
    assert auto.hello["digests"] == reference_digests(checkpoint)


def test_a_name_swapped_under_the_daemon_never_gets_another_users_descriptors(
    node: Node, tmp_path: Path, workers: list[Worker]
) -> None:
    d = node.daemon
    single = synthesize(tmp_path / "single", SynthSpec(rows=2000, shards=1))
    [name] = [p.name for p in single.glob("*.safetensors")]
    private = node.copy_for(ALICE, "private", single)
    alice = Worker(private, d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    # Bob's folder under the root: a file of his own under Alice's file name, and a
    # symlink to Alice's file (which he cannot read). The two trade names, first at the
    # one point that matters, in order (the symlink while the daemon plans and proves,
    # his own file when the fd channel judges him), 10 times; then in a race for 3 s.
    mine = node.root / f"{BOB}" / "race"
    mine.mkdir(parents=True)
    shutil.copy(single / "model.safetensors.index.json", mine)
    (mine / name).write_bytes(b"\0" * 4096)
    (mine / "decoy").symlink_to(private / name)
    for p in (node.root / f"{BOB}", mine, *mine.iterdir()):
        os.chown(p, BOB, node.gid, follow_symlinks=False)
    race = _as(
        node,
        BOB,
        str(SUPPORT / "swap_probe.py"),
        str(d.socket),
        alice.hello["set_id"],
        str(mine),
        name,
        "decoy",
        "10",
        "3",
    )
    assert "won" not in race, race
    # The attack ran: the daemon followed the symlink, proved Alice's file, and the fd
    # channel judged Bob against that file, not against his path: every ordered round.
    refused = sum(n for k, n in race["exchanged"].items() if f"uid {BOB} may not read" in k)
    assert refused == 10, race
    raced = sum(n for k, n in race["outcomes"].items() if f"uid {BOB} may not read" in k)
    assert raced > 0, race


def test_a_symlink_out_of_the_root_reveals_nothing_of_its_target(
    node: Node, tmp_path: Path
) -> None:
    d = node.daemon
    # A root-only file outside the allowed root: its size and first bytes are secrets.
    secret = tmp_path / "vault" / "shadow"
    secret.parent.mkdir(mode=0o700)
    secret.write_bytes(b"root:*:20000:0:99999:7:::\n" + b"x" * 684)
    secret.chmod(0o600)
    mine = node.root / f"{BOB}"
    for name, target in (("there", secret), ("nothing", tmp_path / "vault" / "missing")):
        (mine / name).mkdir(parents=True)
        (mine / name / "a.safetensors").symlink_to(target)
    for p in (mine, *mine.rglob("*")):
        os.chown(p, BOB, node.gid, follow_symlinks=False)
    answers = []
    for name in ("there", "nothing"):
        answer = _as(
            node, BOB, str(SUPPORT / "lease_probe.py"), str(d.socket), "0" * 20, str(mine / name)
        )
        assert answer["error"] == "PERMISSION_DENIED", answer
        assert "outside the allowed root" in answer["message"]
        answers.append(answer["message"].replace(str(mine / name), "<folder>"))
    first8 = str(int.from_bytes(secret.read_bytes()[:8], "little"))
    assert not any(secret_text in answers[0] for secret_text in ("710", first8, "root:"))
    # A target that exists and one that does not get the same answer.
    assert answers[0] == answers[1]


def test_a_caller_learns_nothing_of_files_it_may_not_read(
    node: Node, checkpoint: Path, workers: list[Worker]
) -> None:
    d = node.daemon
    private = node.copy_for(ALICE, "private", checkpoint)
    alice = Worker(private, d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    # Bob names Alice's checkpoint with her set's id: he gets a lease (the worker socket
    # cannot tell who asks) but not her files' names, sizes and inodes, then no descriptor.
    named = _as(
        node,
        BOB,
        str(SUPPORT / "lease_probe.py"),
        str(d.socket),
        alice.hello["set_id"],
        str(private),
    )
    assert named["error"] == "NotAllowed", named
    assert named["sources"] == [], named
    # Alice's broken copy (a truncated shard): Bob learns neither its size nor its bytes.
    broken = node.copy_for(ALICE, "broken", checkpoint)
    shard = broken / SHARD
    size = shard.stat().st_size // 2
    os.truncate(shard, size)
    refused = _as(node, BOB, str(SUPPORT / "lease_probe.py"), str(d.socket), "0" * 20, str(broken))
    assert refused["error"] == "INVALID_ARGUMENT", refused
    assert SHARD not in refused["message"] and "truncated" not in refused["message"], refused
    assert "daemon's log alone" in refused["message"]
    # Alice's own worker is told in full by her own read of the files.
    strict = Worker(broken, d.socket, share="on", user=node.user(ALICE))
    workers.append(strict)
    assert strict.hello["error"] == "CheckpointError", strict.hello
    assert "truncated file" in strict.hello["message"]


@pytest.mark.parametrize(
    "node",
    [["--memory-budget", "64M", "--worker-set-grace", "2", "--sweep-interval", "0.1"]],
    indirect=True,
)
def test_one_users_checkpoints_take_only_their_share_and_leave_when_unleased(
    node: Node, tmp_path: Path, workers: list[Worker]
) -> None:
    d = node.daemon
    ckpts = [synthesize(tmp_path / f"c{i}", SynthSpec(rows=4000, seed=i)) for i in range(4)]
    nbytes = plan_tables(ckpts[0]).nbytes
    # Room for two of Bob's sets in his share, not three (the budget itself holds many).
    share = 2.5 * nbytes / (64 << 20)
    d.stop()
    d.args += ["--worker-share-per-uid", f"{share:.6f}"]
    d.start()
    status = d.status().daemon
    assert status.worker_set_grace_s == 2 and abs(status.worker_share_per_uid - share) < 1e-6
    bobs = [node.copy_for(BOB, f"b{i}", ckpts[i]) for i in range(3)]
    held = []
    for folder in bobs[:2]:
        w = Worker(folder, d.socket, share="on", user=node.user(BOB))
        workers.append(w)
        assert w.hello["mode"] == "shared", w.hello
        held.append(w)
    third = Worker(bobs[2], d.socket, share="on", user=node.user(BOB))
    workers.append(third)
    assert "--worker-share-per-uid" in third.hello.get("message", ""), third.hello
    assert f"files of uid {BOB}" in third.hello["message"]
    # Alice's files are charged to her, not to Bob.
    alice = Worker(node.copy_for(ALICE, "a", ckpts[3]), d.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    # Bob's workers exit: his sets are dropped once unleased for the grace; Alice's stays.
    for w in held:
        assert w.exit() == 0
    wait_until(lambda: len(d.status().sets) == 1, 30, "Bob's unleased sets to be dropped")
    assert [s.set_id for s in d.status().sets] == [alice.hello["set_id"]]
    assert "--worker-set-grace" in d.log
    again = Worker(bobs[2], d.socket, share="on", user=node.user(BOB))
    workers.append(again)
    assert again.hello["mode"] == "shared", again.hello


def _forged_twin(node: Node, checkpoint: Path) -> Path:
    """Alice's copy of the public `checkpoint` with POISONED written into its largest table,
    between the fingerprint's samples, every 2 MiB piece's XXH3 kept (tests/support/
    xxh3_forge.py): the same set id, the same checksums, other bytes."""
    twin = node.copy_for(ALICE, "twin", checkpoint)
    victim = max(plan_tables(twin).tensors, key=lambda t: t.nbytes)
    at = forge(victim.file, victim.offset, 2, b"POISONED")
    assert victim.file.read_bytes()[at : at + 8] == b"POISONED"
    assert plan_tables(twin).set_id == plan_tables(checkpoint).set_id
    assert reference_digests(twin) != reference_digests(checkpoint)
    return twin


def _loads_twin(node: Node, twin: Path, workers: list[Worker]) -> str:
    """Alice attaches her twin: the daemon loads her bytes under the checkpoint's id."""
    alice = Worker(twin, node.daemon.socket, share="on", user=node.user(ALICE))
    workers.append(alice)
    assert alice.hello["mode"] == "shared", alice.hello
    assert alice.hello["digests"] == reference_digests(twin)
    assert alice.exit() == 0
    set_id: str = alice.hello["set_id"]
    return set_id


def _not_published(node: Node, set_id: str, checkpoint: Path, workers: list[Worker]) -> None:
    """Nobody gets the twin's bytes as the checkpoint's: not by id, not by its path."""
    by_id = Worker(set_id, node.daemon.socket, share="on", user=node.user(BOB))
    workers.append(by_id)
    assert by_id.hello.get("error") == "UnknownSet", by_id.hello
    clean = Worker(checkpoint, node.daemon.socket)
    workers.append(clean)
    assert clean.hello["digests"] == reference_digests(checkpoint), clean.hello
    assert all(s.set_id != set_id or not s.published for s in node.daemon.status().sets)


def test_a_forged_twin_adopted_from_disk_is_not_published_when_configured(
    node: Node, checkpoint: Path, workers: list[Worker], tmp_path: Path
) -> None:
    """A group member's twin of a public checkpoint, forged to keep every XXH3 checksum,
    loaded by her attach onto the disk backing; the operator then configures the checkpoint
    and restarts: the adopted set is proven against the checkpoint's files by its strong
    digest, fails, and is never published."""
    d = node.daemon
    disk = tmp_path / "tables"
    disk.mkdir(mode=0o755)
    d.stop()
    d.args += ["--backing", "disk", "--disk-dir", str(disk)]
    d.start()
    set_id = _loads_twin(node, _forged_twin(node, checkpoint), workers)
    assert set_id == plan_tables(checkpoint).set_id
    d.stop()
    d.args += ["--checkpoint", str(checkpoint)]
    d.start(wait="up")
    assert "adopted set " + set_id in d.log
    assert f"cannot load configured checkpoint {checkpoint}" in d.log
    assert "does not hold the bytes" in d.log
    assert not d.status().daemon.ready
    _not_published(node, set_id, checkpoint, workers)


def test_engramd_load_does_not_publish_a_forged_twin(
    node: Node, checkpoint: Path, workers: list[Worker]
) -> None:
    """The same twin held from the member's attach; the operator runs `engramd load` of the
    checkpoint: refused (the strong digests differ), and the twin stays unpublished."""
    d = node.daemon
    set_id = _loads_twin(node, _forged_twin(node, checkpoint), workers)
    loaded = engramd("load", str(checkpoint), "--socket", str(d.socket))
    assert loaded.returncode != 0, loaded.stdout
    assert "does not hold the bytes" in loaded.stderr, loaded.stderr
    _not_published(node, set_id, checkpoint, workers)
