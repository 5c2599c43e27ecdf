"""Workers whose pids the daemon cannot see: the daemon and each worker in pid namespaces
of their own, as Docker and compose run them (every container its own pid namespace).

The daemon runs under `unshare --pid --fork --mount-proc`, each worker under
another `unshare --pid`, as a uid the group database does not know, given the
socket's group only in its own credentials (tests/support/run_as.py
uid:gid:groups, as `setpriv --reuid --regid --groups` gives them, or compose's
`group_add`): no /etc/group line tells the daemon about it, and no /proc entry
of the worker is visible to it. What the kernel checked at the 0660 socket
is what admits it.
"""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon, Worker
from engramd.testing.synth import SynthSpec, synthesize

#: The daemon in a pid namespace (and a /proc) of its own; SIGTERM reaches it when unshare ends.
DAEMON_NS = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
#: A worker in another pid namespace, a sibling of the daemon's.
WORKER_NS = ["unshare", "--pid", "--fork", "--kill-child"]


def _stop(d: Daemon) -> None:
    """Stop the daemon itself: unshare --fork passes no signal on to its child."""
    assert d.proc is not None
    children = Path(f"/proc/{d.pid}/task/{d.pid}/children")
    if d.proc.poll() is None and (pids := children.read_text().split()):
        os.kill(int(pids[0]), signal.SIGTERM)
    d.proc.wait(timeout=30)


def _free_id(taken: set[int]) -> int:
    """An id from the system range that no user or group has here."""
    while True:
        candidate = 61000 + secrets.randbelow(4000)
        if candidate not in taken:
            return candidate


@pytest.fixture
def groups() -> Iterator[tuple[int, int]]:
    """(the socket group's gid, another group's gid): two groups with this test's suffix,
    no member listed in the group database; removed after."""
    if os.geteuid() != 0:
        pytest.skip("creating groups and pid namespaces needs root")
    if subprocess.run([*DAEMON_NS, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid --mount-proc is not allowed here")
    suffix = f"{os.getpid()}{secrets.token_hex(2)}"
    names = [f"edsock{suffix}", f"edckpt{suffix}"]
    try:
        for name in names:
            subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
        gids = [grp.getgrnam(n).gr_gid for n in names]
        assert all(not grp.getgrgid(g).gr_mem for g in gids)
        yield gids[0], gids[1]
    finally:
        for name in names:
            subprocess.run(["groupdel", name], capture_output=True)


def _uid() -> int:
    uid = _free_id({p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()})
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    return uid


def _checkpoint_of_group(into: Path, gid: int, seed: int) -> Path:
    """A checkpoint of its own (no set the operator published holds its bytes) that only
    root and group `gid` may read."""
    synthesize(into, SynthSpec(rows=5_000, seed=seed))
    for p in (into, *into.iterdir()):
        os.chown(p, 0, gid)
        p.chmod(0o750 if p.is_dir() else 0o640)
    return into


@pytest.mark.parametrize("given", ["supplementary", "primary"])
def test_a_worker_in_another_pid_namespace_shares_by_the_group_it_connected_with(
    groups: tuple[int, int],
    open_dirs: tuple[Path, Path, Path],
    workers: list[Worker],
    given: str,
) -> None:
    socket_gid, other_gid = groups
    top, shm, ckpt = open_dirs
    d = Daemon(
        top / "run" / "d.sock",
        shm,
        [
            "--checkpoint",
            str(ckpt),
            "--socket-group",
            grp.getgrgid(socket_gid).gr_name,
            "--allow-root",
            str(top),
        ],
        top / "log",
        python=[*DAEMON_NS, sys.executable],
    ).start()
    try:
        uid = _uid()
        # compose's `group_add: ["990"]` (a supplementary group), or `user: U:990`.
        user = f"{uid}:{uid}:{socket_gid}" if given == "supplementary" else f"{uid}:{socket_gid}"
        w = Worker(ckpt, d.socket, share="on", prefix=WORKER_NS, user=user)
        workers.append(w)
        assert w.hello.get("mode") == "shared", (w.hello, d.log)
        [s] = d.status().sets
        [lease] = s.leases
        # Bound by its secret and uid: its pid is not one the daemon can see.
        assert lease.uid == uid and "fd channel: refused" not in d.log

        # A set the worker's attach loads goes only to a uid that may read its checkpoint:
        # through the socket's group, which connecting proved, it may.
        mine = _checkpoint_of_group(top / "group-only", socket_gid, seed=2)
        w = Worker(mine, d.socket, share="on", prefix=WORKER_NS, user=user)
        workers.append(w)
        assert w.hello.get("mode") == "shared", (w.hello, d.log)

        # Through a group the daemon cannot see (another supplementary group of a pid it
        # cannot look at), it is refused, naming the uid, the groups seen and the fix.
        theirs = _checkpoint_of_group(top / "other-group", other_gid, seed=3)
        groups_given = f"{socket_gid},{other_gid}"
        user = f"{uid}:{uid}:{groups_given}" if given == "supplementary" else f"{uid}:{socket_gid}"
        if given == "primary":
            user += f":{other_gid}"
        w = Worker(theirs, d.socket, share="on", prefix=WORKER_NS, user=user)
        workers.append(w)
        assert w.hello.get("error") == "NotAllowed", (w.hello, d.log)
        primary = uid if given == "supplementary" else socket_gid
        seen = sorted({primary, socket_gid})
        assert f"uid {uid} may not read the checkpoint files of lease" in w.hello["message"]
        assert (
            f"judged with its groups {seen} (its pid is in a pid namespace the daemon cannot "
            "see: its primary group, and the socket's group, which connecting proved): run "
            "the worker as a user that may read its checkpoint" in w.hello["message"]
        ), w.hello["message"]
    finally:
        _stop(d)
