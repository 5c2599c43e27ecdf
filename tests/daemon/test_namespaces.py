"""Workers in another mount and IPC namespace: their own /dev/shm, their own checkpoint view.

Each worker runs under `unshare --mount --ipc`, with mounts the daemon
cannot see, as a container that shares only the socket folder would.
Skipped where creating namespaces is not permitted.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import Worker
from engramd_shared.pb import engramd_pb2 as pb
from helpers import reference_digests, shmem_bytes


@pytest.fixture(autouse=True)
def need_unshare() -> None:
    probe = subprocess.run(
        ["unshare", "--mount", "--ipc", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot create namespaces here ({probe.stderr.strip()}); needs root")


def in_namespace(setup: str) -> list[str]:
    """A command prefix: new mount and IPC namespaces that first run the shell commands `setup`."""
    return [
        "unshare",
        "--mount",
        "--ipc",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{setup} && exec "$@"',
        "sh",
    ]


#: A container's /dev/shm: Docker's default 64 MiB, private to the worker.
OWN_DEV_SHM = "mount -t tmpfs -o size=64m tmpfs /dev/shm"


def test_isolated_workers_share_through_descriptors(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    before = shmem_bytes()
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    expected = reference_digests(checkpoint)
    for _ in range(3):
        w = Worker(checkpoint, d.socket, share="on", prefix=in_namespace(OWN_DEV_SHM))
        workers.append(w)
        assert w.hello["mode"] == "shared", w.hello
        assert w.hello["digests"] == expected
    grown = shmem_bytes() - before
    assert 0.95 * s.bytes <= grown <= 1.05 * s.bytes, f"Shmem grew {grown} for {s.bytes} bytes"
    [s] = d.status().sets
    assert [lease.kind for lease in s.leases] == [pb.HANDLE_KIND_FD] * 3
    # The fd channel saw each worker's pid (SO_PEERCRED): every lease is verified.
    assert all(lease.pid_verified for lease in s.leases)
    assert {lease.pid for lease in s.leases} == {w.proc.pid for w in workers}


def test_no_fd_channel_and_another_dev_shm_falls_back_naming_both_fixes(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    # Only engramd.sock is mounted into this "container": fds.sock is not a socket there.
    fds = shlex.quote(str(d.socket.with_name("fds.sock")))
    hide = in_namespace(f"{OWN_DEV_SHM} && mount --bind /dev/null {fds}")
    auto = Worker(checkpoint, d.socket, prefix=hide)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert "fds.sock" in auto.hello["reason"] and "--ipc" in auto.hello["reason"]
    strict = Worker(checkpoint, d.socket, share="on", prefix=hide)
    workers.append(strict)
    assert strict.hello["error"] == "SegmentNotVisible"
    # Neither keeps a lease: a worker that cannot map the set does not hold it.
    assert [len(s.leases) for s in d.status().sets] == [0]


def test_no_fd_channel_but_the_daemons_dev_shm_maps_by_path(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    fds = shlex.quote(str(d.socket.with_name("fds.sock")))
    by_path = in_namespace(f"mount --bind /dev/null {fds}")
    w = Worker(checkpoint, d.socket, share="on", prefix=by_path)
    workers.append(w)
    assert w.hello["mode"] == "shared"
    assert w.hello["digests"] == reference_digests(checkpoint)
    [s] = d.status().sets
    assert [lease.kind for lease in s.leases] == [pb.HANDLE_KIND_SHM]


def test_different_checkpoint_falls_back_on_fingerprint(
    checkpoint: Path, daemons: Any, workers: list[Worker], tmp_path: Path
) -> None:
    d = daemons("--allow-root", str(checkpoint.parent))
    # The worker's copy differs in one shard's header: another export of "the same" model.
    theirs = tmp_path / "theirs"
    shutil.copytree(checkpoint, theirs)
    shard = theirs / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    pos = data.index(b'"format":"pt"')
    data[pos : pos + 13] = b'"format":"PT"'
    shard.write_bytes(bytes(data))
    swap = in_namespace(f"mount --bind {shlex.quote(str(theirs))} {shlex.quote(str(checkpoint))}")
    auto = Worker(checkpoint, d.socket, prefix=swap)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert "differ" in auto.hello["reason"]
    strict = Worker(checkpoint, d.socket, share="on", prefix=swap)
    workers.append(strict)
    assert strict.hello["error"] == "FingerprintMismatch"
    assert list(d.status().sets) == []  # nothing loaded for a worker it cannot serve
