"""Who may do what: real unprivileged users, the admin socket, allowed roots, the budget."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import SUPPORT, Daemon, Worker, as_user, wait_until
from engramd.testing.synth import SynthSpec, synthesize
from engramd_client import plan_tables
from engramd_client.fdchannel import collect
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from helpers import RawLease, attach_error, reason

GROUP = "engramd-t"
MEMBER = "engramd-tm"
OUTSIDER = "engramd-to"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    """A group and two users made for the test (a member and an outsider), removed after."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    _remove_users()  # what an interrupted earlier run may have left
    _run("groupadd", "--system", GROUP)
    _run("useradd", "--system", "--no-create-home", "-G", GROUP, MEMBER)
    _run("useradd", "--system", "--no-create-home", OUTSIDER)
    try:
        yield
    finally:
        _remove_users()


def _remove_users() -> None:
    for user in (MEMBER, OUTSIDER):
        subprocess.run(["userdel", "--force", user], capture_output=True)
    subprocess.run(["groupdel", GROUP], capture_output=True)


@pytest.fixture
def group_daemon(users: None, open_dirs: tuple[Path, Path, Path]) -> Iterator[Daemon]:
    """A daemon whose socket group is the test group, serving the open checkpoint."""
    top, shm, ckpt = open_dirs
    d = Daemon(
        top / "run" / "d.sock",
        shm,
        ["--checkpoint", str(ckpt), "--socket-group", GROUP],
        top / "log",
    ).start()
    try:
        yield d
    finally:
        d.stop()


def test_only_the_group_may_attach_or_read(
    group_daemon: Daemon, open_dirs: tuple[Path, Path, Path], workers: list[Worker]
) -> None:
    top, shm, ckpt = open_dirs
    d = group_daemon
    [s] = d.status().sets
    folder = sets_root(shm) / s.set_id
    assert stat.S_IMODE((top / "run").stat().st_mode) == 0o750
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o660
    assert stat.S_IMODE(d.socket.with_name("fds.sock").stat().st_mode) == 0o660
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    files = list(folder.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o640 for f in files)

    member = Worker(ckpt, d.socket, share="on", user=MEMBER)
    workers.append(member)
    assert member.hello["mode"] == "shared"

    outsider = Worker(ckpt, d.socket, share="on", user=OUTSIDER)
    workers.append(outsider)
    assert outsider.hello["error"] == "NotAllowed"
    assert "permission denied" in outsider.hello["message"]
    peek = subprocess.run(
        ["runuser", "-u", OUTSIDER, "--", "cat", str(folder / "0000.bin")],
        capture_output=True,
        text=True,
    )
    assert peek.returncode != 0 and "Permission denied" in peek.stderr
    # The admin socket is the owner's alone, group or not.
    admin = subprocess.run(
        [*as_user(MEMBER), "-m", "engramd", "drop", s.set_id, "--socket", str(d.socket)],
        capture_output=True,
        text=True,
    )
    assert admin.returncode == 1 and [x.set_id for x in d.status().sets] == [s.set_id]


def test_fd_channel_refuses_a_peer_outside_the_group(
    group_daemon: Daemon, open_dirs: tuple[Path, Path, Path]
) -> None:
    top = open_dirs[0]
    d = group_daemon
    [s] = d.status().sets
    fds = d.socket.with_name("fds.sock")
    # As if an operator loosened the modes: now only SO_PEERCRED stands in the way.
    (top / "run").chmod(0o751)
    fds.chmod(0o666)
    with RawLease(d, s.set_id) as lease:
        secret = lease.attachment.fd_channel.secret
        probe = [str(fds), lease.attachment.lease_id, secret]
        outsider = subprocess.run(
            [*as_user(OUTSIDER), str(SUPPORT / "fd_probe.py"), *probe],
            capture_output=True,
            text=True,
        )
        who = pwd.getpwnam(OUTSIDER)
        refused = json.loads(outsider.stdout)
        assert refused["error"] == "NotAllowed", outsider.stderr
        # The groups it was judged by (its pid is visible: /proc), and the fix.
        assert refused["message"].startswith(
            f"engramd's fd channel refused: uid {who.pw_uid} is neither root, engramd's user, "
            f"nor in the socket's group (gid {grp.getgrnam(GROUP).gr_gid}): the daemon saw its "
            f"groups [{who.pw_gid}] (from /proc/"
        ), refused
        assert refused["message"].endswith(
            f"{fds} lets every user connect (mode 0666), so connecting proves nothing; make "
            "the socket 0660 again (restart engramd), and give the worker the socket's group "
            "(usermod -aG, compose's group_add, a pod's supplementalGroups)"
        ), refused
        # Nothing was granted: the secret is still unspent for its own worker.
        fds_granted = collect(str(fds), lease.attachment.lease_id, secret, 10)
        assert fds_granted
        for fd in fds_granted.values():
            os.close(fd)


def test_worker_socket_serves_no_admin(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    with d.channel() as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.AdminServiceStub(ch).Drop(pb.DropRequest(set_id=s.set_id), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert [x.set_id for x in d.status().sets] == [s.set_id]


def _attach_code(d: Daemon, ckpt: Path, set_id: str = "") -> grpc.StatusCode | None:
    err = attach_error(d, pb.AttachRequest(set_id=set_id or "0" * 20, checkpoint=str(ckpt)))
    return None if err is None else err.code()


def test_allowed_root_cannot_be_escaped(checkpoint: Path, daemons: Any, tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    shutil.copytree(checkpoint, outside)
    (root / "link").symlink_to(outside)
    d = daemons("--allow-root", str(root))
    set_id = plan_tables(outside).set_id
    assert _attach_code(d, root / ".." / "outside", set_id) == grpc.StatusCode.PERMISSION_DENIED
    assert _attach_code(d, root / "link", set_id) == grpc.StatusCode.PERMISSION_DENIED
    # A bind mount puts outside files under the root's path: the mount gives it away.
    bound = root / "bound"
    bound.mkdir()
    if subprocess.run(["mount", "--bind", str(outside), str(bound)]).returncode != 0:
        pytest.skip("bind mounts need root")
    try:
        assert _attach_code(d, bound, set_id) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        subprocess.run(["umount", str(bound)], check=True)
    # The same checkpoint really inside the root loads.
    shutil.copytree(outside, root / "inside")
    assert _attach_code(d, root / "inside", set_id) is None


def test_memory_budget_and_idle_eviction(
    tmp_path: Path, daemons: Any, workers: list[Worker]
) -> None:
    one = synthesize(tmp_path / "one", SynthSpec(rows=20_000, seed=1))
    two = synthesize(tmp_path / "two", SynthSpec(rows=20_000, seed=2))
    budget = str(int(1.5 * plan_tables(one).nbytes))
    d = daemons("--allow-root", str(tmp_path), "--memory-budget", budget)
    w = Worker(one, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared"
    err = attach_error(d, pb.AttachRequest(set_id=plan_tables(two).set_id, checkpoint=str(two)))
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(err) == "budget" and "--evict-idle" in str(err.details())
    d.stop()

    d.args += ["--evict-idle", "--adopt-grace", "0"]
    d.start()
    wait_until(lambda: sum(len(s.leases) for s in d.status().sets) == 1, 10, "the lease back")
    # The first set is still leased (the worker re-attached): it must not be evicted.
    assert _attach_code(d, two, plan_tables(two).set_id) == grpc.StatusCode.RESOURCE_EXHAUSTED
    w.exit()
    assert _attach_code(d, two, plan_tables(two).set_id) is None
    assert [s.checkpoint for s in d.status().sets] == [str(two)]
    assert "evicting idle set" in d.log


@pytest.mark.parametrize("owner, mode", [(0, 0o777), (65534, 0o755), (0, 0o770)])
def test_daemon_refuses_a_socket_folder_others_may_write(
    sock_dir: Path, shm_dir: Path, owner: int, mode: int
) -> None:
    run = sock_dir / "run"
    run.mkdir()
    os.chown(run, owner, owner)
    run.chmod(mode)
    d = Daemon(run / "d.sock", shm_dir, [], sock_dir / "daemon.log")
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    assert f"the socket folder {run} must be engramd's own and writable by no one else" in d.log
    assert not any(p.is_socket() for p in run.iterdir())


def test_a_worker_maps_nothing_from_whoever_may_write_the_socket_folder(
    users: None, checkpoint: Path, sock_dir: Path, workers: list[Worker]
) -> None:
    # The operator's socket folder, writable by everyone (an emptyDir's 0777):
    # a member of the group stands in for the daemon there with one of his own.
    sock_dir.chmod(0o755)
    run = sock_dir / "run"
    run.mkdir(mode=0o777)
    run.chmod(0o777)
    public = sock_dir / "models" / "ckpt"
    shutil.copytree(checkpoint, public)
    for p in (public.parent, *public.parent.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    member = pwd.getpwnam(MEMBER)
    mine = sock_dir / "member"
    mine.mkdir()
    os.chown(mine, member.pw_uid, member.pw_gid)
    planted = Daemon(
        mine / "d.sock",
        mine,
        ["--checkpoint", str(public), "--socket-group", "", "--backing", "memfd"],
        sock_dir / "member.log",
        python=as_user(MEMBER),
    ).start()
    try:
        for name in ("d.sock", "fds.sock"):
            (run / name).symlink_to(mine / name)
        strict = Worker(public, run / "d.sock", share="on")
        workers.append(strict)
        assert strict.hello["error"] == "SegmentNotVisible", strict.hello
        assert "can stand in for the daemon" in strict.hello["message"]
        assert "mode 0777" in strict.hello["message"]
        auto = Worker(public, run / "d.sock")
        workers.append(auto)
        assert auto.hello["mode"] == "private", auto.hello
    finally:
        planted.stop()
