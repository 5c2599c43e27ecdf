"""Daemons in network namespaces for the fleet tests: nodes, the veth between them, the
fleet's token, and what a node's set holds (tests/daemon/test_fleet.py,
tests/daemon/test_fleet_exposure.py).

The fixtures (`net`, `nodes`, `token_file`, `big_checkpoint`) reach every test
through tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import SUPPORT, Daemon, wait_until
from engramd.host.hugeroot import remove_shm_folder, unmount_below
from engramd.testing.child import JsonLinesChild
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from fleet_lab import UCX_TCP, Net, netns_missing, veth_pair

TOKEN = "fleet-token-0123456789abcdef"


def nixl_missing() -> str:
    """Why NIXL cannot run here, or "" (for a skip mark)."""
    # Found, not imported: NIXL's bundled libraries (absl among them) loaded into
    # the test process crash protoc's (tests/unit/test_proto_stubs.py) later in it.
    if importlib.util.find_spec("nixl_cu12") is None:
        return "NIXL is not installed (nixl_cu12); `make setup` installs it"
    return ""


@pytest.fixture
def net() -> Iterator[Net]:
    """Namespaces `<tag>a` and `<tag>b` joined by a veth; removed after."""
    missing = netns_missing()
    if missing:
        pytest.skip(f"{missing} (CI runs as root and `make test-tools` installs iproute2)")
    with veth_pair(f"edf{os.getpid() % 100000}") as pair:
        yield pair


@pytest.fixture
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 42 MB of tables: a fill under a rate cap lasts long enough to be killed."""
    return synthesize(tmp_path_factory.mktemp("fleet") / "engram", SynthSpec(rows=80_000))


class Node:
    """One daemon with a socket folder and shm folder of its own, perhaps in a namespace."""

    def __init__(self, name: str, python: str = sys.executable) -> None:
        #: The interpreter the daemon runs on (another venv's, for the install test).
        self.python = python
        self.sock_dir = Path(tempfile.mkdtemp(prefix=f"ed{name}", dir="/tmp"))
        self.shm_dir = Path(tempfile.mkdtemp(prefix=f"engramd-fleet-{name}-", dir="/dev/shm"))
        self.daemon: Daemon | None = None
        self._started: tuple[list[str], str, dict[str, str] | None] = ([], "", None)

    def restart(self) -> Daemon:
        """Start the daemon again as it was last started (its earlier run has ended)."""
        return self.start(*self._started)

    def start(
        self, args: list[str], netns: str = "", env: dict[str, str] | None = None, wait: str = "up"
    ) -> Daemon:
        self._started = (args, netns, env)
        python = [*Net.run_in(netns), self.python] if netns else [self.python]
        self.daemon = Daemon(
            self.sock_dir / "d.sock",
            self.shm_dir,
            [*args, "--no-huge-tmpfs"],
            self.sock_dir / "daemon.log",
            {**UCX_TCP, **(env or {})},
            python,
        )
        return self.daemon.start(wait=wait)

    def close(self) -> None:
        d = self.daemon
        if d is not None and d.proc is not None and d.proc.poll() is None:
            d.stop(signal.SIGKILL)
        unmount_below(sets_root(self.shm_dir))
        remove_shm_folder(self.shm_dir)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture
def nodes() -> Iterator[Any]:
    """Make nodes: `nodes("a")` (`python=` another interpreter); each one's daemon is killed
    and its folders removed after."""
    made: list[Node] = []

    def make(name: str, python: str = sys.executable) -> Node:
        made.append(Node(name, python))
        return made[-1]

    yield make
    for node in made:
        node.close()


def write_token(path: Path, token: str) -> Path:
    """A token file as the daemon takes it: its owner's alone (0400)."""
    path.write_text(token + "\n")
    path.chmod(0o400)
    return path


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A file holding TOKEN, the fleet's token, as the daemon takes it."""
    return write_token(tmp_path / "token", TOKEN)


def ready_set(d: Daemon, timeout: float = 120) -> pb.SetInfo:
    """The daemon's one set once it is ready (fails on a failed load)."""
    found: list[pb.SetInfo] = []

    def done() -> bool:
        try:
            sets = d.status().sets
        except grpc.RpcError:
            # A daemon that died answers nothing: its exit and its log say why.
            assert d.proc is not None
            if d.proc.poll() is not None:
                raise AssertionError(f"engramd exited with {d.proc.returncode}:\n{d.log}") from None
            raise
        assert all(s.state != "failed" for s in sets), [s.error for s in sets]
        found[:] = [s for s in sets if s.state == "ready"]
        return bool(found)

    wait_until(done, timeout, "the set to be ready")
    return found[0]


def set_digests(shm_dir: Path, set_id: str) -> dict[str, str]:
    """sha256 of each tensor's bytes in a daemon's published (tmpfs) set."""
    folder = sets_root(shm_dir) / set_id
    manifest = json.loads((folder / "manifest.json").read_text())
    out = {}
    for t in manifest["tensors"]:
        with open(folder / t["file"], "rb") as f:
            f.seek(t["offset"])
            out[t["name"]] = hashlib.sha256(f.read(t["nbytes"])).hexdigest()
    return out


def checkpoint_digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of each selected tensor's bytes as the checkpoint's files hold them (a table
    joined from row shards: its shards back to back)."""
    out = {}
    for t in plan_tables(checkpoint).tensors:
        digest = hashlib.sha256()
        for span in t.spans:
            with open(span.file, "rb") as f:
                f.seek(span.offset)
                digest.update(f.read(span.nbytes))
        out[t.name] = digest.hexdigest()
    return out


def serving(node: Node, checkpoint: Path, net: Net, token: Path, *extra: str) -> Daemon:
    """`node`'s daemon in namespace a, serving `checkpoint`'s set to peers on ip_a:7077."""
    d = node.start(
        [
            "--checkpoint",
            str(checkpoint),
            "--peer-listen",
            f"{net.ip_a}:7077",
            "--peer-token-file",
            str(token),
            *extra,
        ],
        net.a,
        wait="serving",
    )
    return d


def receiving(node: Node, checkpoint: Path, net: Net, token: Path, *extra: str) -> Daemon:
    """`node`'s daemon in namespace b, filling `checkpoint`'s set from the peer at ip_a:7077."""
    return node.start(
        [
            "--checkpoint",
            str(checkpoint),
            "--peers",
            f"{net.ip_a}:7077",
            "--peer-token-file",
            str(token),
            *extra,
        ],
        net.b,
    )


@contextlib.contextmanager
def rogue_peer(
    net: Net, checkpoint: Path, port: int, mode: str, upstream: str = ""
) -> Iterator[tuple[JsonLinesChild, dict[str, Any]]]:
    """tests/support/rogue_peer.py in namespace a on `port` (MODE, UPSTREAM as it takes them),
    and what it printed once listening; stopped after."""
    rogue = JsonLinesChild(
        [
            *Net.run_in(net.a),
            *(sys.executable, str(SUPPORT / "rogue_peer.py")),
            *(f"{net.ip_a}:{port}", str(checkpoint), mode),
            *([upstream] if upstream else []),
        ],
        env={**os.environ, **UCX_TCP},
    )
    try:
        started = rogue.read()
        assert started["listening"], started
        yield rogue, started
    finally:
        assert rogue.proc.stdin is not None
        rogue.proc.stdin.close()
        rogue.proc.wait(timeout=30)


@contextlib.contextmanager
def lying_store(net: Net, folder: Path, lie: str) -> Iterator[dict[str, str]]:
    """tests/support/lying_s3.py serving `folder`'s files in namespace b on port 9000, lying
    by `lie`; the AWS variables that reach it from namespace a. Stopped after."""
    liar = subprocess.Popen(
        [
            *(*Net.run_in(net.b), sys.executable, str(SUPPORT / "lying_s3.py")),
            *(net.ip_b, "9000", str(folder), lie),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert liar.stdout is not None and liar.stdout.readline().strip() == "listening"
        yield {
            "AWS_ENDPOINT_URL": f"http://{net.ip_b}:9000",
            "AWS_ACCESS_KEY_ID": "liar",
            "AWS_SECRET_ACCESS_KEY": "liar",
            "AWS_REGION": "us-east-1",
        }
    finally:
        liar.kill()
        liar.wait()
