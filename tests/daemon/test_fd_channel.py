"""The fd channel: read-only descriptors for a lease's own process, and nothing for anyone else.

Each test speaks to the real daemon's fds.sock as a worker (or an attacker
holding a worker's secret) would, from this process or a child.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, wait_until
from engramd.backings.memfd import SEALS
from engramd_client.fdchannel import collect
from engramd_shared.errors import NotAllowed
from engramd_shared.pb import engramd_pb2 as pb
from helpers import RawLease, open_fds


def fd_socket(d: Any) -> str:
    return str(d.socket.with_name("fds.sock"))


def take(d: Any, lease: RawLease) -> dict[str, int]:
    """The lease's descriptors, as its worker collects them."""
    return collect(fd_socket(d), lease.attachment.lease_id, lease.attachment.fd_channel.secret, 10)


def exchange(d: Any, data: bytes) -> pb.FdReply:
    """Send raw bytes as a request; the daemon's one reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(fd_socket(d))
        s.send(data)
        return pb.FdReply.FromString(s.recv(65536))


@pytest.mark.parametrize("backing", ["tmpfs", "memfd"])
def test_received_descriptors_are_read_only(checkpoint: Path, daemons: Any, backing: str) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--backing", backing)
    [s] = d.status().sets
    assert s.backing == backing
    with RawLease(d, s.set_id) as lease:
        handles = lease.attachment.tensors
        assert {h.WhichOneof("handle") for h in handles} == {"fd"}
        fds = take(d, lease)
        try:
            assert set(fds) == {h.fd.file for h in handles}
            for fd in fds.values():
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                with pytest.raises(OSError) as wrote:
                    os.pwrite(fd, b"x", 0)
                assert wrote.value.errno == errno.EBADF
                with pytest.raises(OSError) as truncated:
                    os.ftruncate(fd, 0)
                assert truncated.value.errno in (errno.EBADF, errno.EINVAL)
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
                if backing == "memfd":
                    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        finally:
            for fd in fds.values():
                os.close(fd)


def test_secret_is_one_time_and_bound_to_a_live_lease(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    with RawLease(d, s.set_id) as lease, RawLease(d, s.set_id) as other:
        lease_id, secret = lease.attachment.lease_id, lease.attachment.fd_channel.secret
        for wrong_id, wrong_secret in (
            (lease_id, other.attachment.fd_channel.secret),  # another lease's secret
            (lease_id, ""),
            ("0" * 12, secret),
        ):
            with pytest.raises(NotAllowed, match="no live lease"):
                collect(fd_socket(d), wrong_id, wrong_secret, 10)
        # A wrong guess does not spend the secret; the first right one does.
        for fd in take(d, lease).values():
            os.close(fd)
        with pytest.raises(NotAllowed, match="no live lease"):
            take(d, lease)
    # The daemon ends a lease when it sees its stream go, a moment after the cancel.
    wait_until(lambda: d.status().sets[0].lease_count == 0, 10, "both leases to end")
    with pytest.raises(NotAllowed, match="no live lease"):
        take(d, other)


def test_lease_of_another_process_is_refused(checkpoint: Path, daemons: Any) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        # A lease made in the bystander's name; this process holds its secret.
        with (
            RawLease(d, s.set_id, pid=bystander.pid) as lease,
            pytest.raises(NotAllowed, match=f"belongs to pid {bystander.pid}"),
        ):
            take(d, lease)
    finally:
        bystander.kill()
        bystander.wait()


def test_bad_clients_leave_the_daemon_serving_and_its_descriptors_flat(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets

    def cycle() -> None:
        with RawLease(d, s.set_id) as lease:
            for fd in take(d, lease).values():
                os.close(fd)

    for _ in range(20):
        cycle()
    baseline = open_fds(d.pid)

    assert "not an engramd.v1.FdRequest" in exchange(d, b"\xff" * 100).error
    assert "longer than 1024 bytes" in exchange(d, b"\x0a" * 2048).error
    whole = pb.FdRequest(lease_id="a" * 12, secret="b" * 32).SerializeToString()
    assert "not an engramd.v1.FdRequest" in exchange(d, whole[:20]).error
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mute:
        mute.connect(fd_socket(d))
        cycle()  # a client that never speaks holds up nobody
        mute.settimeout(30)
        assert mute.recv(1) == b""  # the daemon gave up on it (REQUEST_TIMEOUT_S)
    for _ in range(50):
        # A worker that asks and goes away before reading: the descriptors in
        # flight die with its socket.
        with (
            RawLease(d, s.set_id) as lease,
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as gone,
        ):
            gone.connect(fd_socket(d))
            gone.send(
                pb.FdRequest(
                    lease_id=lease.attachment.lease_id, secret=lease.attachment.fd_channel.secret
                ).SerializeToString()
            )
    for _ in range(200):
        cycle()
    # The last connections close on the daemon's side a moment after this side's.
    wait_until(lambda: open_fds(d.pid) <= baseline + 2, 10, f"the daemon's fds near {baseline}")
    assert d.status().sets[0].state == "ready"


def test_a_second_daemon_does_not_take_a_live_fd_channel(
    checkpoint: Path, daemons: Any, sock_dir: Path
) -> None:
    d = daemons()
    other = Daemon(
        sock_dir / "other.sock",
        d.shm_dir,
        ["--fd-socket", fd_socket(d), "--admin-socket", str(sock_dir / "other-admin.sock")],
        sock_dir / "other.log",
    )
    with pytest.raises(RuntimeError, match="exited with 1"):
        other.start()
    assert f"another engramd is serving on {fd_socket(d)}" in other.log
    assert os.path.exists(fd_socket(d))  # the first daemon's channel is still there


def test_refused_requests_of_one_uid_log_one_line_not_one_each(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    bogus = pb.FdRequest(lease_id="a" * 12, secret="b" * 32).SerializeToString()
    for _ in range(200):
        assert exchange(d, bogus).error
    refusals = [line for line in d.log.splitlines() if "fd channel: refused" in line]
    assert len(refusals) == 1, refusals
    # The channel still serves a real worker.
    with RawLease(d, s.set_id) as lease:
        for fd in take(d, lease).values():
            os.close(fd)
