"""No idle peer shuts others out: per-uid caps, deadlines and shares, as real users.

The fd channel knows each peer's uid (SO_PEERCRED): its connections and the
leases that collect descriptors are capped per uid. The worker socket
(gRPC) knows no peer: idle connections end after a timeout, never take the
descriptors kept for the admin socket, and the admin socket answers status.
A daemon under umask 077 still makes its sets readable by the socket group.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import SUPPORT, Daemon, Worker, as_user, wait_until
from engramd.testing.synth import SynthSpec, synthesize
from engramd_client.fdchannel import FdChannelUnreachable, collect
from engramd_shared.channel import open_channel
from engramd_shared.checkpoint import plan_tables
from engramd_shared.config import ClientConfig
from engramd_shared.errors import ShareError
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import RawLease, reference_digests

GROUP = "engramd-pg"
ALICE = "engramd-pa"
BOB = "engramd-pb"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _remove_users() -> None:
    for user in (ALICE, BOB):
        subprocess.run(["userdel", "--force", user], capture_output=True)
    subprocess.run(["groupdel", GROUP], capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, int]]:
    """Two users of the socket group, made for these tests; their uids."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    _remove_users()  # what an interrupted earlier run may have left
    _run("groupadd", "--system", GROUP)
    for user in (ALICE, BOB):
        _run("useradd", "--system", "--no-create-home", "-G", GROUP, user)
    try:
        yield pwd.getpwnam(ALICE).pw_uid, pwd.getpwnam(BOB).pw_uid
    finally:
        _remove_users()


@pytest.fixture
def group_daemons(users: tuple[int, int], open_dirs: tuple[Path, Path, Path]) -> Iterator[Any]:
    """Make daemons whose socket group is the test group, serving the open checkpoint."""
    top, shm, ckpt = open_dirs
    started: list[Daemon] = []

    def make(*args: str, python: list[str] | None = None, shm_dir: Path = shm) -> Daemon:
        d = Daemon(
            top / "run" / "d.sock",
            shm_dir,
            ["--checkpoint", str(ckpt), "--socket-group", GROUP, *args],
            top / "log",
            python=python,
        )
        started.append(d)
        return d.start()

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


def _leases(d: Daemon) -> list[pb.LeaseInfo]:
    return [lease for s in d.status().sets for lease in s.leases]


def _lease(d: Daemon, lease_id: str) -> pb.LeaseInfo:
    [lease] = [x for x in _leases(d) if x.lease_id == lease_id]
    return lease


class Flood:
    """support/fd_flood.py as a user: idle connections to the fd channel, remade as they close."""

    def __init__(self, fd_socket: Path, count: int, user: str) -> None:
        self.proc = subprocess.Popen(
            [*as_user(user), str(SUPPORT / "fd_flood.py"), str(fd_socket), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.connected = int(self.proc.stdout.readline().split(":")[1].strip(" }\n"))

    def stop(self) -> int:
        """End the flood; returns how many connections it had to make again."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            return -1
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        self.proc.wait(timeout=30)
        return int(line.split(":")[1].strip(" }\n"))


# -- the fd channel (item 3) -------------------------------------------------------


def test_idle_fd_connections_of_one_user_leave_another_its_descriptors(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons("--fd-connections-per-uid", "4")
    alice, bob = pwd.getpwnam(ALICE).pw_uid, pwd.getpwnam(BOB).pw_uid
    flood = Flood(d.socket.with_name("fds.sock"), 80, ALICE)
    try:
        assert flood.connected >= 64  # the channel's whole cap, from one user
        wait_until(
            lambda: f"(uid {alice}): uid {alice} holds 4 connections" in d.log,
            30,
            "the daemon to refuse the flooding user's connections over its cap",
        )
        for i in range(3):
            w = Worker(ckpt, d.socket, share="on", user=BOB, labels={"i": str(i)})
            workers.append(w)
            assert w.hello["mode"] == "shared", w.hello
            lease = _lease(d, w.hello["lease_id"])
            # Bob's descriptors came over the flooded channel, with his uid and pid.
            assert lease.kind == pb.HANDLE_KIND_FD
            assert lease.uid == bob and lease.pid_verified and lease.pid == w.proc.pid
        # The flooding user's own worker is still served: descriptors or paths.
        w = Worker(ckpt, d.socket, share="on", user=ALICE)
        workers.append(w)
        assert w.hello["mode"] == "shared", w.hello
    finally:
        reconnects = flood.stop()
    # The flood was refused and cut off throughout, not merely left waiting.
    assert reconnects > 0
    assert d.proc is not None and d.proc.poll() is None


@contextlib.contextmanager
def _fake_channel(path: Path, behaviour: str) -> Iterator[None]:
    """A SOCK_SEQPACKET listener that misbehaves on each connection it accepts.

    "reset": closes once the request arrived, unread (the worker's read then
    fails with ECONNRESET); "close": closes at once (the worker's send or read
    fails); "busy": answers as a daemon at its cap does, and closes.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(8)
    listener.settimeout(0.05)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                if behaviour == "reset":
                    conn.settimeout(10)
                    with contextlib.suppress(OSError):
                        conn.recv(0, socket.MSG_PEEK)
                elif behaviour == "busy":
                    reply = pb.FdReply(error="engramd's fd channel is busy: a test", reason="busy")
                    with contextlib.suppress(OSError):
                        conn.send(reply.SerializeToString())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()
        path.unlink()


@pytest.mark.parametrize("behaviour", ["reset", "close", "busy"])
def test_a_failing_fd_channel_is_a_share_error(tmp_path: Path, behaviour: str) -> None:
    path = tmp_path / "fds.sock"
    with _fake_channel(path, behaviour):
        for _ in range(20):  # "close" races the worker's send: both orders must hold
            with pytest.raises(FdChannelUnreachable) as caught:
                collect(str(path), "lease", "secret", timeout_s=0.3)
            assert isinstance(caught.value, ShareError)
            assert "fd channel" in str(caught.value)
    # Nothing listens any more: refused.
    path.touch()
    with pytest.raises(FdChannelUnreachable, match="cannot reach"):
        collect(str(path), "lease", "secret", timeout_s=0.3)


def test_a_worker_whose_channel_resets_maps_by_path_then_loads_privately(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    top, _, ckpt = open_dirs
    d = group_daemons()
    fake = top / "fake-fds.sock"
    with _fake_channel(fake, "reset"):
        fake.chmod(0o666)
        env = ["env", f"ENGRAMD_FD_SOCKET={fake}"]
        by_path = Worker(ckpt, d.socket, share="on", user=BOB, prefix=env)
        workers.append(by_path)
        assert by_path.hello["mode"] == "shared", by_path.hello
        assert _lease(d, by_path.hello["lease_id"]).kind == pb.HANDLE_KIND_SHM
        # Descriptors only: no path to fall back to, so private (auto) or the
        # ShareError (strict), never an uncaught OSError.
        only_fds = [*env, "ENGRAMD_HANDLES=fd"]
        private = Worker(ckpt, d.socket, user=BOB, prefix=only_fds)
        workers.append(private)
        assert private.hello["mode"] == "private", private.hello
        assert "fd channel" in private.hello["reason"]
        strict = Worker(ckpt, d.socket, share="on", user=BOB, prefix=only_fds)
        workers.append(strict)
        assert strict.hello["error"] == "FdChannelUnreachable", strict.hello
        assert strict.proc.wait(timeout=30) == 3 and "Traceback" not in strict.stderr()
    # The refused attempts' leases ended with them; the path worker's is the one left.
    wait_until(lambda: len(_leases(d)) == 1, 10, "the failed attempts' leases to end")


# -- leases (item 4) ---------------------------------------------------------------


def test_each_uid_holds_its_share_of_leases(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons("--leases-per-uid", "2", "--max-leases", "16")
    alice, bob = pwd.getpwnam(ALICE).pw_uid, pwd.getpwnam(BOB).pw_uid
    for _ in range(2):
        workers.append(Worker(ckpt, d.socket, share="on", user=ALICE))
        assert workers[-1].hello["mode"] == "shared"
    third = Worker(ckpt, d.socket, share="on", user=ALICE)
    workers.append(third)
    assert third.hello["error"] == "TooManyLeases"
    assert f"uid {alice} hold 2 leases" in third.hello["message"]
    assert "--leases-per-uid" in third.hello["message"]
    auto = Worker(ckpt, d.socket, user=ALICE)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    # Alice's share is full; Bob's is his.
    for _ in range(2):
        workers.append(Worker(ckpt, d.socket, share="on", user=BOB))
        assert workers[-1].hello["mode"] == "shared"
    wait_until(lambda: len(_leases(d)) == 4, 10, "the refused leases to end")
    assert sorted(lease.uid for lease in _leases(d)) == sorted([alice, alice, bob, bob])
    # Path handles tell the daemon no uid: all of them together hold one share.
    paths = ["env", "ENGRAMD_HANDLES=shm"]
    for _ in range(2):
        workers.append(Worker(ckpt, d.socket, share="on", user=ALICE, prefix=paths))
        assert workers[-1].hello["mode"] == "shared"
    refused = Worker(ckpt, d.socket, share="on", user=BOB, prefix=paths)
    workers.append(refused)
    assert "engramd cannot know" in refused.hello["message"]
    # ... and never a worker that collects descriptors: its uid is known.
    root = Worker(ckpt, d.socket, share="on")
    workers.append(root)
    assert root.hello["mode"] == "shared"
    assert _lease(d, root.hello["lease_id"]).uid == 0


def test_a_pid_is_verified_only_by_the_kernel(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons()
    bob = pwd.getpwnam(BOB).pw_uid
    # Bob claims pid 1, with pid 1's namespace and start time, on the gRPC socket.
    probe = subprocess.run(
        [*as_user(BOB), str(SUPPORT / "claim_probe.py"), str(d.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    claimed = {k: v for k, v in (kv.split("=") for kv in probe.stdout.split())}
    # It held its lease while it looked: status showed pid 1, not verified, uid unknown.
    assert claimed == {"pid": "1", "pid_verified": "False", "uid": "unknown"}
    # A worker of Bob's that collects its descriptors: the kernel names it.
    w = Worker(ckpt, d.socket, share="on", user=BOB)
    workers.append(w)
    lease = _lease(d, w.hello["lease_id"])
    assert lease.pid_verified and lease.pid == w.proc.pid and lease.uid == bob
    # Bob's lease claiming pid 1 cannot collect descriptors either (pid 1 is not Bob).
    set_id = d.status().sets[0].set_id
    with RawLease(d, set_id, pid=1) as raw:
        reply = subprocess.run(
            [
                *as_user(BOB),
                str(SUPPORT / "fd_probe.py"),
                str(d.socket.with_name("fds.sock")),
                raw.attachment.lease_id,
                raw.attachment.fd_channel.secret,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "belongs to pid 1" in reply.stdout, reply.stdout + reply.stderr
        # Its secret was presented by another process: the lease ended, unverified.
        assert all(x.lease_id != raw.attachment.lease_id for x in _leases(d))


def test_a_descriptor_lease_that_never_collects_ends_and_a_reattached_one_shows_itself(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons("--leases-per-uid", "1")
    bob = pwd.getpwnam(BOB).pw_uid
    set_id = d.status().sets[0].set_id
    # A first attach for descriptors that never comes for them: ended by the sweep.
    with d.channel() as ch:
        request = pb.AttachRequest(set_id=set_id, pid=os.getpid(), accept=[pb.HANDLE_KIND_FD])
        call = pb_grpc.TableServiceStub(ch).Attach(request, timeout=60)
        try:
            [attached] = [e.attached for e in itertools.islice(call, 1)]
            gone = attached.lease_id
            wait_until(
                lambda: all(x.lease_id != gone for x in _leases(d)),
                30,
                "the sweep to end the lease that never collected its descriptors",
            )
            assert "did not collect its descriptors" in d.log
        finally:
            call.cancel()
    # Bob's worker keeps its lease across a restart; the re-established lease
    # meets the fd channel again, so it is Bob's (his one lease) and verified.
    w = Worker(ckpt, d.socket, share="on", user=BOB)
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert d.stop() == 0
    d.start()

    def mine() -> list[pb.LeaseInfo]:
        return [x for x in _leases(d) if x.pid == w.proc.pid and x.pid_verified]

    wait_until(lambda: mine(), 30, "the worker to re-establish its lease")
    [lease] = mine()
    assert lease.uid == bob and lease.lease_id != w.hello["lease_id"]
    assert w.ask("lease")["lease_id"] == lease.lease_id


def test_refused_leases_end_and_keep_no_set_held(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    top, _, ckpt = open_dirs
    # Alice's own checkpoint, which only she may read; the daemon (root) reads it for Bob.
    folder = top / "alice"
    mine = synthesize(folder / "engram", SynthSpec(rows=2000, seed=1))
    alice = pwd.getpwnam(ALICE).pw_uid
    for p in (folder, mine, *mine.iterdir()):
        os.chown(p, alice, alice)
    folder.chmod(0o700)
    set_id = plan_tables(mine).set_id
    d = group_daemons(
        *("--allow-root", str(top), "--max-leases", "3"),
        *("--worker-set-grace", "1", "--sweep-interval", "0.1"),
    )
    # Bob attaches it 6 times (loaded at his request, charged to Alice) and presents each
    # lease on the fd channel, which refuses him: every one of them ends at once.
    holder = subprocess.Popen(
        [
            *as_user(BOB),
            str(SUPPORT / "refused_leases.py"),
            *(str(d.socket), str(d.socket.with_name("fds.sock")), str(mine), set_id, "6"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert json.loads(holder.stdout.readline()) == {"refused": ["NotAllowed"] * 6}
        assert not [lease for s in d.status().sets if s.set_id == set_id for lease in s.leases]
        # Nothing holds Alice's set: it is dropped once unleased for the grace.
        wait_until(
            lambda: all(s.set_id != set_id for s in d.status().sets),
            30,
            "the set no lease holds to be dropped",
        )
        # The limit counts what is granted: three workers, not one more.
        for _ in range(3):
            workers.append(Worker(ckpt, d.socket, share="on", user=ALICE))
            assert workers[-1].hello["mode"] == "shared", workers[-1].hello
        fourth = Worker(ckpt, d.socket, share="on", user=ALICE)
        workers.append(fourth)
        assert fourth.hello["error"] == "TooManyLeases", fourth.hello
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == {"ended": 6}
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert "may not read the checkpoint files of lease" in d.log


# -- one member's header storm (round 3, item 3) -------------------------------------

#: The storm's headers: under the 16 MiB a worker's checkpoint may have. One long
#: metadata string: decoded and parsed in 30-80 ms that never let go of the interpreter.
STORM_HEADER_BYTES = 12_000_000


def _huge_header(checkpoint: Path, to: Path) -> Path:
    """A copy of `checkpoint` whose first shard's header is padded to STORM_HEADER_BYTES."""
    shutil.copytree(checkpoint, to)
    shard = sorted(to.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    doc = json.loads(data[8 : 8 + length])
    doc["__metadata__"] = {**doc.get("__metadata__", {}), "pad": "x" * STORM_HEADER_BYTES}
    header = json.dumps(doc).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length :])
    return to


def test_a_members_header_storm_leaves_another_members_attach_within_a_second(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path]
) -> None:
    """Bob attaches checkpoints with 12 MB headers from 48 threads for 10 s; Alice's
    attaches of the published set share within 1 s at p99 meanwhile."""
    top, _, ckpt = open_dirs
    bob = pwd.getpwnam(BOB).pw_uid
    storm_ckpts = []
    for i in range(3):
        folder = _huge_header(ckpt, top / f"storm{i}")
        for p in (folder, *folder.iterdir()):
            os.chown(p, bob, bob)
        storm_ckpts.append(str(folder))
    d = group_daemons("--allow-root", str(top))
    seconds = "10"
    storm = subprocess.Popen(
        [
            *as_user(BOB),
            str(SUPPORT / "header_storm.py"),
            str(d.socket),
            seconds,
            "48",
            *storm_ckpts,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        timed = subprocess.run(
            [*as_user(ALICE), str(SUPPORT / "attach_times.py"), str(d.socket), str(ckpt), seconds],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out, _ = storm.communicate(timeout=120)
    finally:
        if storm.poll() is None:
            storm.kill()
            storm.wait()
    assert timed.returncode == 0, timed.stderr
    times = json.loads(timed.stdout)
    storm_result = json.loads(out)
    assert times["errors"] == [], times["errors"]
    # Bob's storm ran throughout, touching his files so each attach is planned again;
    # past his share of the daemon's time his large headers are refused at once.
    assert storm_result["codes"].get("RESOURCE_EXHAUSTED", 0) > 0, storm_result
    took = sorted(times["seconds"])
    assert len(took) >= 10, took
    # p99 (the slowest but one in a hundred); measured 0.55-0.63 s with 40-45 attaches in
    # 10 s on two shared cores (main: 1.5 s, and 2.0 s timeouts in the review's run).
    assert took[int(0.99 * (len(took) - 1))] < 1.0, took


# -- the worker socket (item 8) ------------------------------------------------------


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _connections_on(pid: int, path: Path) -> int:
    """The daemon's accepted connections on the socket at `path` (its listener not counted).

    The kernel lists an accepted Unix socket under its listener's path.
    """
    on_path = set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[7] == str(path):
            on_path.add(fields[6])
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            held += target.startswith("socket:[") and target[8:-1] in on_path
    return held - 1


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the daemon closed `s` (what it sent before is read and dropped)."""
    try:
        while s.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_idle_connections_to_the_worker_socket_end_and_leave_the_admin_socket_room(
    daemons: Any, checkpoint: Path, workers: list[Worker]
) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1024:
        pytest.skip(f"this test needs 1024 descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # 512 open files, 256 of them kept from the worker socket; idle connections end in 1 s.
    d = daemons(
        "--checkpoint",
        str(checkpoint),
        "--idle-timeout",
        "1",
        "--fd-reserve",
        "256",
        python=["prlimit", "--nofile=512:512", sys.executable],
    )
    assert d.proc is not None
    pid = d.proc.pid
    before = _open_files(pid)
    flood: list[socket.socket] = []
    try:
        for _ in range(600):  # more connections than the daemon may open files
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.socket))
            flood.append(s)
        wait_until(lambda: _open_files(pid) >= before + 200, 30, "the daemon to take the flood in")
        # The operator still looks, on the admin socket's own descriptors.
        status = subprocess.run(
            [sys.executable, "-m", "engramd", "status", "--socket", str(d.socket), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert str(checkpoint) in status.stdout
        admin = ClientConfig(socket=str(d.socket.with_name("admin.sock")))
        with open_channel(admin) as ch:
            reply = pb_grpc.AdminServiceStub(ch).Status(pb.StatusRequest(), timeout=10)
        assert [s.checkpoint for s in reply.sets] == [str(checkpoint)]
        # The flood never took more than the worker socket's share of descriptors (the
        # admin connections just made may still be closing: they are not counted).
        assert _connections_on(pid, d.socket) <= 512 - 256
        # After the idle timeout the daemon closed every one of them, taken in late or not.
        wait_until(
            lambda: all(_closed_by_peer(s) for s in flood),
            60,
            "the daemon to close the idle connections",
        )
    finally:
        for s in flood:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared", w.hello
    assert "Too many open files" not in d.log


# -- umask (item 9) -----------------------------------------------------------------


def test_a_daemon_under_umask_077_serves_paths_to_its_group(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    top, open_shm, ckpt = open_dirs
    shm = open_shm / "made-by-engramd"
    d = group_daemons(
        python=["sh", "-c", 'umask 077 && exec "$@"', "sh", sys.executable], shm_dir=shm
    )
    assert d.proc is not None
    assert "Umask:\t0077" in Path(f"/proc/{d.proc.pid}/status").read_text()
    [s] = d.status().sets
    folder = sets_root(shm) / s.set_id

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    made = (top / "run", shm, sets_root(shm), folder)
    assert [mode(p) for p in made] == [0o750] * 4
    assert all(mode(f) == 0o640 for f in folder.iterdir())
    assert mode(d.socket) == mode(d.socket.with_name("fds.sock")) == 0o660
    # A member of the group (not root: the kernel judges the modes) maps the files by path.
    w = Worker(ckpt, d.socket, share="on", user=BOB, prefix=["env", "ENGRAMD_HANDLES=shm"])
    workers.append(w)
    assert w.hello["mode"] == "shared", w.hello
    assert _lease(d, w.hello["lease_id"]).kind == pb.HANDLE_KIND_SHM
    assert w.hello["digests"] == reference_digests(ckpt)


# -- held calls on the worker socket (F2) -------------------------------------------


def test_no_call_holds_a_worker_socket_connection_past_its_request_deadline(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons("--idle-timeout", "1")
    # Bob holds Watch streams and Status calls whose request never comes, on 8 connections.
    holder = subprocess.Popen(
        [*as_user(BOB), str(SUPPORT / "hold_calls.py"), str(d.socket), "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Alice's worker is served meanwhile.
        alice = Worker(ckpt, d.socket, share="on", user=ALICE)
        workers.append(alice)
        assert alice.hello["mode"] == "shared", alice.hello
        out, err = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    held = json.loads(out)
    # Watch is not offered on the worker socket; probes watch on the admin socket.
    assert held["watch"] == ["UNIMPLEMENTED"] * 8, err
    # The half-sent calls were cut by the daemon after its 1 s deadline, not by Bob's 20 s.
    assert held["half"] == ["DEADLINE_EXCEEDED"] * 8, err
    assert "did not arrive whole within 1 s" in held["details"]
    assert held["seconds"] < 10
    with open_channel(ClientConfig(socket=str(d.socket))) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    assert alice.ask("lookups 0.2")["bad"] == 0


def test_uncollected_attaches_of_one_user_shut_no_one_out(
    group_daemons: Any, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    _, _, ckpt = open_dirs
    d = group_daemons("--max-leases", "4", "--leases-per-uid", "2")
    alice = pwd.getpwnam(ALICE).pw_uid
    # Bob attaches for descriptors 6 times and never collects: nothing is granted yet.
    holder = subprocess.Popen(
        [*as_user(BOB), str(SUPPORT / "hold_leases.py"), str(d.socket), "6"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert json.loads(holder.stdout.readline()) == {"attached": 6, "refused": []}
        # Alice's workers collect theirs meanwhile: granted, charged to her uid.
        for _ in range(2):
            workers.append(Worker(ckpt, d.socket, share="on", user=ALICE))
            assert workers[-1].hello["mode"] == "shared", workers[-1].hello
        granted = [lease for lease in _leases(d) if lease.HasField("uid")]
        assert [lease.uid for lease in granted] == [alice, alice]
        # Bob's share and the node's limit still hold where leases are granted.
        third = Worker(ckpt, d.socket, share="on", user=ALICE)
        workers.append(third)
        assert third.hello["error"] == "TooManyLeases", third.hello
        assert "--leases-per-uid" in third.hello["message"]
    finally:
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        holder.wait(timeout=30)
