"""Workers in another mount namespace: a different /dev/shm, a different checkpoint.

Each worker runs under `unshare --mount`, with a mount the daemon cannot
see, as a container that shares only the socket folder would. Skipped where
creating mount namespaces is not permitted.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import Worker


@pytest.fixture(autouse=True)
def need_unshare() -> None:
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here ({probe.stderr.strip()}); needs root")


def in_namespace(setup: str) -> list[str]:
    """A command prefix: a new mount namespace that first runs the shell commands `setup`."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{setup} && exec "$@"',
        "sh",
    ]


def test_other_dev_shm_falls_back_naming_the_ipc_namespace(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    hide = in_namespace(f"mount -t tmpfs tmpfs {shlex.quote(str(d.shm_dir))}")
    auto = Worker(checkpoint, d.socket, prefix=hide)
    workers.append(auto)
    assert auto.hello["mode"] == "private"
    assert "--ipc" in auto.hello["reason"] and "/dev/shm" in auto.hello["reason"]
    strict = Worker(checkpoint, d.socket, share="on", prefix=hide)
    workers.append(strict)
    assert strict.hello["error"] == "SegmentNotVisible"
    # Neither keeps a lease: a worker that cannot map the set does not hold it.
    assert [len(s.leases) for s in d.status().sets] == [0]


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
