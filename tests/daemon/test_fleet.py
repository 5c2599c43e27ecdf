"""Sets filled from a peer daemon (two network namespaces, a veth, NIXL over TCP) and from
an object store (s3rver), verified, with fallback to the files; real daemons throughout.

Each peer test makes two network namespaces joined by a veth and removes
them; the daemons run in them under `ip netns exec`, which also mounts the
namespace's own /sys (UCX finds its network devices there: under a plain
`nsenter --net` it sees the host's). Their sets go to the shared /dev/shm
(--no-huge-tmpfs: a tmpfs the daemon mounted would stay inside the mount
namespace `ip netns exec` makes). UCX_TLS=tcp: between processes of one host
UCX would otherwise pick cma and never touch the network.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from fleet_nodes import (
    checkpoint_digests,
    lying_store,
    nixl_missing,
    ready_set,
    receiving,
    serving,
    set_digests,
    write_token,
)

from conftest import Daemon, Worker, huge_pages, mounted_hugetlbfs, wait_until
from engramd.cli.status_view import render
from engramd.fleet.peer import addresses
from engramd.fleet.swarmfill import RESTARTS, STALL_S
from engramd.strong import pieces
from engramd.testing.synth import PleSpec, synthesize_ple
from engramd.units import gib
from engramd_shared.checkpoint import plan_tables
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from fleet_lab import (
    S3,
    Net,
    free_port,
    s3rver,
    s3rver_missing,
)
from helpers import attach_error, reference_digests

MiB = 1 << 20

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen4Exp PLE tables in 7 row shards over 2 files: each set tensor is joined from shards."""
    return synthesize_ple(tmp_path_factory.mktemp("ple") / "qwen", PleSpec())


def no_partial_loads(shm_dir: Path) -> bool:
    return not any(".loading" in p.name for p in sets_root(shm_dir).iterdir())


# -- peers --------------------------------------------------------------------------------


def test_peer_addresses_from_a_list_and_a_name(caplog: pytest.LogCaptureFixture) -> None:
    """--peers: HOST:PORT entries, comma-separated or repeated; a name is each of its addresses;
    what cannot be used is skipped with a log line."""
    found = addresses(["10.1.0.1:7077,10.1.0.2:7077", "localhost:7078", "nope", "10.1.0.1:7077"])
    resolved = {
        str(ai[4][0]) for ai in socket.getaddrinfo("localhost", 7078, type=socket.SOCK_STREAM)
    }
    expected = ["10.1.0.1:7077", "10.1.0.2:7077"] + [
        f"[{ip}]:7078" if ":" in ip else f"{ip}:7078" for ip in resolved
    ]
    assert sorted(found) == sorted(expected)
    assert found[:2] == ["10.1.0.1:7077", "10.1.0.2:7077"]
    assert "peer 'nope' is not HOST:PORT; skipped" in caplog.text
    assert addresses(["no-such-host.invalid:7077"]) == []
    assert "does not resolve" in caplog.text


def test_fill_from_a_peer_over_tcp(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """B fills its set from A over the veth: the same bytes, the same id, source named."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file)
    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    assert s.set_id == plan_tables(checkpoint).set_id
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    assert "filling set" in a.daemon.log
    assert no_partial_loads(b.shm_dir)
    # The serving side says what it served, once the receiver's stream ended.
    size = gib(s.bytes)
    served = re.compile(
        rf"peer ipv4:{re.escape(net.ip_b)}:\d+: served set {s.set_id}: {size} of {size} in "
        r"[\d.]+ s \([\d.]+ GB/s\)"
    )
    wait_until(lambda: served.search(a.daemon.log), 10, "the serving side's line")


@pytest.mark.parametrize("backing", ["memfd", "hugetlbfs"])
def test_fill_from_a_peer_into_each_backing(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, backing: str
) -> None:
    """The landed windows move into a memfd set by write(2), which is then sealed (no
    writable mapping may be left), and into a hugetlbfs set, which takes no write(2)."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file)
    with contextlib.ExitStack() as held:
        if backing == "hugetlbfs":
            granted = held.enter_context(huge_pages(2 * MiB, 32))
            assert granted == 32, f"asked the kernel for 32 pages of 2 MiB, got {granted}"
            b.shm_dir.rmdir()  # the node's own folder: its daemon serves the mount instead
            b.shm_dir = held.enter_context(mounted_hugetlbfs(2 * MiB))
        rb = receiving(b, checkpoint, net, token_file, "--backing", backing)
        # Before its huge pages are given back.
        held.callback(rb.stop, signal.SIGKILL)
        s = ready_set(rb)
        assert (s.source, s.backing) == (f"peer {net.ip_a}:7077", backing), rb.log
        worker = Worker(checkpoint, rb.socket, share="on")
        try:
            assert worker.hello["mode"] == "shared", worker.hello
            assert worker.hello["digests"] == reference_digests(checkpoint)
        finally:
            worker.exit()


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of `pid` and of the children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        # A thread may end between the listing and the read (the fill's, or gRPC's).
        with contextlib.suppress(FileNotFoundError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


#: recvmsg(2)'s number, the call a ready spare transfer process blocks in.
_RECVMSG = {"x86_64": 47, "aarch64": 212}[platform.machine()]


def _waiting_for_a_fill(pid: int) -> bool:
    """Whether `pid` (a transfer process) is blocked in recvmsg, waiting for the daemon."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(_RECVMSG)
    except (FileNotFoundError, ProcessLookupError):
        return False


def _ss_pids(*args: str, netns: str = "") -> set[int]:
    """The pids of the sockets `ss ARGS` shows in `netns` (this one's: "")."""
    shown = subprocess.run(
        [*(Net.run_in(netns) if netns else []), "ss", "-Hnp", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(p) for p in re.findall(r"pid=(\d+)", shown)}


def _listening_pids(netns: str = "") -> set[int]:
    """The pids with a listening TCP socket in `netns` (this one's: "")."""
    return _ss_pids("-lt", netns=netns)


def test_idle_fleet_daemons_spin_nothing(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """Once the fill is over, neither daemon keeps a transfer process with a backend (no UCX
    listener, no progress thread; the spare started for the next fill listens nowhere) and
    both idle at about 0% CPU, their children included; an agent made at start-up spun a
    core."""
    a, b = nodes("a"), nodes("b")
    da = serving(a, checkpoint, net, token_file)
    db = receiving(b, checkpoint, net, token_file)
    assert ready_set(db).source == f"peer {net.ip_a}:7077", db.log
    pids = {ns: d.status().daemon.pid for ns, d in ((net.a, da), (net.b, db))}

    def only_spares() -> bool:
        return all(
            len(_children(pid)) <= 1
            and not set(_children(pid)) & _listening_pids(ns)
            and all(_waiting_for_a_fill(c) for c in _children(pid))
            for ns, pid in pids.items()
        )

    # A fill's end starts the next spare, whose start (an interpreter, NIXL's plugins)
    # is not idling: it is measured once it waits for a fill.
    wait_until(only_spares, 30, "the fills' transfer processes to end, the spares to be ready")
    tree = [p for pid in pids.values() for p in (pid, *_children(pid))]
    before = [_cpu_seconds(p) for p in tree]
    idle_s = 3.0
    time.sleep(idle_s)  # what is measured is the CPU over a stretch of wall time
    used = sum(_cpu_seconds(p) - t for p, t in zip(tree, before, strict=True))
    # A spinning progress thread takes ~idle_s; idle daemons and spares a few ticks.
    assert used < idle_s * 0.1, used


def test_wrong_token_falls_back_to_files(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    """Two daemons with different tokens: the server's proof fails the receiver's key, so the
    receiver sends no proof of its own and loads from its files; the server is left."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file)
    wrong = write_token(tmp_path / "wrong", "another-token-0123456789")
    rb = receiving(b, checkpoint, net, wrong)
    s = ready_set(rb)
    assert s.source == "files"
    assert f"peer {net.ip_a}:7077 could not prove it holds the fleet's token; refused" in rb.log
    assert "left before proving it holds the fleet's token" in a.daemon.log
    assert "filling set" not in a.daemon.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def test_wrong_bytes_are_refused(net: Net, nodes: Any, checkpoint: Path, token_file: Path) -> None:
    """A peer whose copy was altered after publishing attests none of it (its checksums from
    the load no longer hold); nothing of it is published."""
    a, b = nodes("a"), nodes("b")
    ra = serving(a, checkpoint, net, token_file)
    s = ready_set(ra)
    folder = sets_root(a.shm_dir) / s.set_id
    victim = sorted(p for p in folder.iterdir() if p.name != "manifest.json")[0]
    with open(victim, "r+b") as f:
        f.seek(4096)
        old = f.read(16)
        f.seek(4096)
        f.write(bytes(x ^ 0xFF for x in old))
    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == "files"
    assert "changed since it was loaded (tensor " in rb.log
    assert "no longer has the checksum it was loaded with; not offered" in ra.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def test_peer_killed_mid_fill(net: Net, nodes: Any, big_checkpoint: Path, token_file: Path) -> None:
    """The serving daemon dies while B reads: once asking it again got nothing for STALL_S, B
    reads the pieces it still needs from its files and keeps those it has; nothing
    half-published."""
    a, b = nodes("a"), nodes("b")
    # 4 MB/s: the fill of ~42 MB lasts about 10 s.
    ra = serving(a, big_checkpoint, net, token_file, "--peer-rate", "4M")
    rb = receiving(b, big_checkpoint, net, token_file)

    def reading() -> bool:
        return any(s.bytes_loaded > 0 and s.source.startswith("peer") for s in rb.status().sets)

    wait_until(reading, 60, "B to read from A")
    ra.stop(signal.SIGKILL)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077, files", rb.log
    given = dict(s.bytes_by_source)
    assert given.keys() == {f"{net.ip_a}:7077", "files"} and sum(given.values()) == s.bytes
    assert f"peer {net.ip_a}:7077: the peer's stream broke mid-fill" in rb.log
    assert f"after {STALL_S:.0f} s" in rb.log and "; those pieces come from the files" in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)
    assert no_partial_loads(b.shm_dir)
    assert [x.set_id for x in rb.status().sets] == [s.set_id]


def test_a_peer_below_the_floor_is_left(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """A peer serving under --peer-rate 1M, a receiver with --peer-min-rate 4M: the peer is
    dropped after its first pieces, and the rest come from the files at once (it is not
    asked again)."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file, "--peer-rate", "1M")
    rb = receiving(b, checkpoint, net, token_file, "--peer-min-rate", "4M")
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077, files", rb.log
    assert "too slow" in rb.log and "--peer-min-rate" in rb.log
    assert "no peer left holds every piece still needed (peer " in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--peer-listen", "127.0.0.1:0"], "need --peer-token-file"),
        (["--peers", "127.0.0.1:1", "--peer-token-file", "/nonexistent"], "No such file"),
        (["--object-store", "http://bucket/prefix"], "is not s3://bucket/prefix"),
        (["--checkpoint", "s3://bucket/prefix"], "which needs --peer-token-file"),
    ],
)
def test_fleet_flags_refused_with_the_fix(nodes: Any, args: list[str], message: str) -> None:
    """Peer and object-store flags that cannot work stop the daemon with what to do."""
    node = nodes("x")
    with pytest.raises(RuntimeError, match="exited with"):
        node.start(args)
    assert message in node.daemon.log


def test_a_short_token_is_refused(nodes: Any, tmp_path: Path) -> None:
    """A token a peer could guess is no token: at least 16 characters."""
    short = tmp_path / "short"
    write_token(short, "abc")
    node = nodes("x")
    with pytest.raises(RuntimeError, match="exited with"):
        node.start(["--peer-listen", "127.0.0.1:0", "--peer-token-file", str(short)])
    assert "holds 3 characters; use at least 16" in node.daemon.log


def test_a_set_a_worker_loaded_never_leaves_the_node(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """A holds the set only because a worker's attach loaded it (owner-only): not offered."""
    a, b = nodes("a"), nodes("b")
    ra = a.start(
        [
            "--allow-root",
            str(checkpoint.parent),
            "--peer-listen",
            f"{net.ip_a}:7077",
            "--peer-token-file",
            str(token_file),
        ],
        net.a,
        wait="serving",
    )
    request = pb.AttachRequest(set_id=plan_tables(checkpoint).set_id, checkpoint=str(checkpoint))
    assert attach_error(ra, request) is None
    held = ready_set(ra)
    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.set_id == held.set_id
    assert s.source == "files", rb.log
    assert "NOT_FOUND" in rb.log and "serves no published set" in rb.log


def _receiving_processes(pid: int) -> set[int]:
    """The daemon's transfer processes that map a landing ring (its fill reads with them)."""
    found = set()
    for child in _children(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if "engramd-landing" in Path(f"/proc/{child}/maps").read_text():
                found.add(child)
    return found


def _connected_pids(port: int | None) -> set[int]:
    """The pids with a TCP connection to `port` in this network namespace."""
    return _ss_pids("-t", "state", "established", f"( dport = :{port} )")


def test_the_receiving_transfer_process_ended_keeps_the_verified_pieces(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """B's receiving transfer process is killed mid-fill: another takes its place and B goes
    on from A with the pieces it verified; killed a third time, B leaves the peers and its
    files give only the pieces it still lacks."""
    a, b = nodes("a"), nodes("b")
    serving(a, big_checkpoint, net, token_file, "--peer-rate", "4M")
    rb = receiving(b, big_checkpoint, net, token_file)
    killed: list[int] = []
    for _ in range(RESTARTS + 1):
        wait_until(
            lambda: (
                bool(_receiving_processes(rb.pid) - set(killed))
                and any(s.bytes_loaded > 0 for s in rb.status().sets)
            ),
            60,
            "B to read from A with a transfer process not yet killed",
        )
        (pid,) = _receiving_processes(rb.pid) - set(killed)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    s = ready_set(rb)
    peer = f"{net.ip_a}:7077"
    assert s.source == f"peer {peer}, files", rb.log
    given = dict(s.bytes_by_source)
    assert given.keys() == {peer, "files"} and sum(given.values()) == s.bytes, given
    assert given[peer] > 0 and given["files"] < s.bytes
    kept = [
        int(n)
        for n in re.findall(
            r"the receiving transfer process ended \(killed by SIGKILL\); another takes its "
            r"place, (\d+) verified pieces kept",
            rb.log,
        )
    ]
    assert len(kept) == RESTARTS and kept[0] > 0 and kept == sorted(kept), rb.log
    said = (
        rf"ended {RESTARTS + 1} times, the last: the receiving transfer process ended \(killed "
        r"by SIGKILL\); (\d+) verified pieces kept, the rest from the object store and the files"
    )
    last = re.search(said, rb.log)
    assert last is not None and int(last.group(1)) >= kept[-1], rb.log
    assert "loading from the files" not in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)
    assert no_partial_loads(b.shm_dir)
    assert rb.proc is not None and rb.proc.poll() is None


def test_receiver_killed_mid_fill(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """B dies while it reads: A lets go of the stream and serves the next fill; B's restart
    removes the partial load and fills again from A."""
    a, b = nodes("a"), nodes("b")
    ra = serving(a, big_checkpoint, net, token_file, "--peer-rate", "4M")
    rb = receiving(b, big_checkpoint, net, token_file)

    def reading() -> bool:
        return any(s.bytes_loaded > 0 and s.source.startswith("peer") for s in rb.status().sets)

    wait_until(reading, 60, "B to read from A")
    rb.stop(signal.SIGKILL)
    assert not any(
        p.name == plan_tables(big_checkpoint).set_id for p in sets_root(b.shm_dir).iterdir()
    )
    rb = b.restart()
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    assert "removing partial load" in rb.log
    assert no_partial_loads(b.shm_dir)
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)
    assert ra.proc is not None and ra.proc.poll() is None
    assert ra.log.count("filling set") == 2


# -- object store -------------------------------------------------------------------------


@pytest.fixture
def s3() -> Iterator[S3]:
    """s3rver on a free port, bucket "tables" (`make test-tools` installs it with npm)."""
    missing = s3rver_missing()
    if missing:
        pytest.skip(missing)
    with s3rver() as store:
        yield store


def test_fill_from_the_object_store(s3: S3, nodes: Any, checkpoint: Path, token_file: Path) -> None:
    """No peer answers; the object store's files fill the set, straight into its memory."""
    s3.upload(checkpoint, "models/engram")
    s3.attest(checkpoint, "models/engram", token_file)
    node = nodes("s")
    d = node.start(
        [
            "--checkpoint",
            str(checkpoint),
            # Nothing listens there: the peer is passed over with its reason.
            "--peers",
            f"127.0.0.1:{free_port()}",
            "--peer-token-file",
            str(token_file),
            "--object-store",
            f"s3://{s3.bucket}/models/engram",
            "--metrics-port",
            str(metrics_port := free_port()),
        ],
        env=s3.env(),
    )
    s = ready_set(d)
    url = f"s3://{s3.bucket}/models/engram"
    assert s.source == url, d.log
    assert "trying the next source" in d.log
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    # Where it came from, and at what rate, in status, its table and the metrics.
    shown = subprocess.run(
        [sys.executable, "-m", "engramd", "status", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"{url} {s.bytes / s.load_seconds / 1e9:.2f} GB/s" in " ".join(shown.stdout.split())
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    labels = f'checkpoint="{checkpoint}",node="",set_id="{s.set_id}"'
    assert f'engramd_set_source{{{labels},source="{url}"}} 1.0' in metrics
    # What the load took from the store, counted by source.
    received = f'engramd_received_bytes_total{{source="{url}"}} '
    [count] = [line for line in metrics.splitlines() if line.startswith(received)]
    assert float(count.split()[-1]) == s.bytes, metrics


@pytest.mark.parametrize("lie", ["late", "window", "whole", "more"])
def test_a_lying_object_store_leaves_the_daemon_alive(
    net: Net, nodes: Any, checkpoint: Path, lie: str
) -> None:
    """An S3 endpoint in another namespace fails one range while the request's others are
    still landing (the header's, or a table window's), ignores Range, or sends more than a
    range: the fill fails in its transfer process, which ends before the daemon reuses the
    memory; the daemon lives, and its files fill the set."""
    with lying_store(net, checkpoint, lie) as env:
        node = nodes("s")
        d = node.start(
            ["--checkpoint", str(checkpoint), "--object-store", "s3://bucket/m"], net.a, env=env
        )
        s = ready_set(d)
        assert d.proc is not None and d.proc.poll() is None, d.log
        assert s.source == "files", d.log
        assert "s3://bucket/m: " in d.log and "loading from the files" in d.log, d.log
        assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
        assert no_partial_loads(node.shm_dir)
        # The daemon serves on: a worker's status call after the failed fill.
        assert d.status().daemon.ready


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_bad_object_falls_back_to_files(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path, damage: str
) -> None:
    """A missing or a truncated object: refused before a tensor is read; the files fill it."""
    s3.attest(checkpoint, "m", token_file)
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    if damage == "missing":
        for name in shards[1:]:
            s3.put(f"m/{name}", (checkpoint / name).read_bytes())
    else:
        s3.upload(checkpoint, "m", cut={shards[-1]: (checkpoint / shards[-1]).stat().st_size - 1})
    node = nodes("s")
    d = node.start(
        [
            *("--checkpoint", str(checkpoint), "--object-store", f"s3://{s3.bucket}/m"),
            *("--peer-token-file", str(token_file)),
        ],
        env=s3.env(),
    )
    s = ready_set(d)
    assert s.source == "files", d.log
    assert "loading from the files" in d.log
    assert f"s3://{s3.bucket}/m/{shards[-1] if damage == 'truncated' else shards[0]}" in d.log
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    assert no_partial_loads(node.shm_dir)


def test_joined_shards_from_a_peer(
    net: Net, nodes: Any, ple_checkpoint: Path, token_file: Path
) -> None:
    """PLE tables joined from row shards across files come whole from a peer."""
    assert any(t.parts for t in plan_tables(ple_checkpoint).tensors)
    a, b = nodes("a"), nodes("b")
    serving(a, ple_checkpoint, net, token_file)
    rb = receiving(b, ple_checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(ple_checkpoint)


def _peer_and_store(
    a: Any, b: Any, s3: S3, checkpoint: Path, token_file: Path, rate: str
) -> tuple[str, str, Daemon]:
    """A serving `checkpoint`'s set on loopback under --peer-rate `rate`; B's daemon filling
    it from A and the bucket's prefix "m"; A's address, the store's URL, B's daemon."""
    url, peer = f"s3://{s3.bucket}/m", f"127.0.0.1:{free_port()}"
    args = ["--checkpoint", str(checkpoint), "--peer-token-file", str(token_file)]
    ready_set(a.start([*args, "--peer-listen", peer, "--peer-rate", rate]))
    return peer, url, b.start([*args, "--peers", peer, "--object-store", url], env=s3.env())


def test_pieces_from_a_peer_and_the_object_store_at_once(
    s3: S3, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """B fills from peer A, held to 4 MB/s by --peer-rate, and from the object store at once
    (both on this host's loopback): each gives pieces, each compared with the attested piece
    digests; B's set is the checkpoint's, and status names both shares. The store's transfer
    process listens nowhere meanwhile."""
    s3.upload(big_checkpoint, "m")
    a, b = nodes("a"), nodes("b")
    peer, url, d = _peer_and_store(a, b, s3, big_checkpoint, token_file, "4M")
    # B's two receiving transfer processes, while both read: the store's (the one connected
    # to the store) listens nowhere; the peers' listens (UCX), which shows the look works.
    store_port = urlparse(s3.env()["AWS_ENDPOINT_URL"]).port
    landing: set[int] = set()

    def both_reading() -> bool:
        landing.update(_receiving_processes(d.pid))
        return len(landing) == 2 and bool(_connected_pids(store_port) & landing)

    wait_until(both_reading, 60, "B to read from the peer and the store")
    (store,) = _connected_pids(store_port) & landing
    (peers,) = landing - {store}
    listening = _listening_pids()
    assert store not in listening and peers in listening, (store, peers, listening)
    s = ready_set(d)
    given = dict(s.bytes_by_source)
    assert set(given) == {peer, url} and all(given.values()), (given, d.log)
    assert sum(given.values()) == s.bytes
    assert s.source == f"peer {peer}, {url}", d.log
    shares = [
        f"{name} {100 * n // s.bytes}%" for name, n in ((peer, given[peer]), (url, given[url]))
    ]
    assert f"peer {shares[0]}, {shares[1]}" in " ".join(render(d.status(), width=400).split())
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)


def test_an_object_store_that_lies_about_a_piece_is_dropped(
    s3: S3, nodes: Any, big_checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    """The bucket holds the checkpoint with a row of every piece zeroed: B drops the store at
    the first piece it gave, and peer A gives every piece."""
    evil = tmp_path / "evil"
    shutil.copytree(big_checkpoint, evil)
    for entry in plan_tables(big_checkpoint).tensors:
        (span,) = entry.spans
        with open(evil / Path(span.file).name, "r+b") as f:
            for at, n in pieces(entry.nbytes):
                f.seek(span.offset + at + n // 2)
                f.write(bytes(256))
    s3.upload(evil, "m")
    a, b = nodes("a"), nodes("b")
    peer, url, d = _peer_and_store(a, b, s3, big_checkpoint, token_file, "16M")
    s = ready_set(d)
    assert s.source == f"peer {peer}", d.log
    assert dict(s.bytes_by_source) == {peer: s.bytes}
    assert re.search(rf"{url}: it sent piece \d+ .* another digest than the attested one", d.log)
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)


def test_joined_shards_from_the_object_store(
    s3: S3, nodes: Any, ple_checkpoint: Path, token_file: Path
) -> None:
    """Each shard of a joined table is read from its own object, at its own offset."""
    s3.upload(ple_checkpoint, "qwen")
    s3.attest(ple_checkpoint, "qwen", token_file)
    node = nodes("s")
    d = node.start(
        [
            *("--checkpoint", str(ple_checkpoint), "--object-store", f"s3://{s3.bucket}/qwen"),
            *("--peer-token-file", str(token_file)),
        ],
        env=s3.env(),
    )
    s = ready_set(d)
    assert s.source == f"s3://{s3.bucket}/qwen", d.log
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(ple_checkpoint)
