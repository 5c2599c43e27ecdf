"""What of a daemon the peer network reaches, attacked from another network namespace.

The attacker knows only the daemon's address. It scans every TCP port there,
and runs a NIXL agent of its own (tests/support/nixl_forge.py) that forges
metadata for whatever UCX listener the scan found (its own metadata with the
target's address and port, one memory section covering all of user space):
UCX over TCP serves a GET or PUT at any address to anyone who connects, so a
listener is the whole memory of the process that owns it. What holds is that
the daemon owns none: between fills nothing but its configured ports listens,
and during a fill the only UCX listeners are the transfer processes' (children
of the daemons), on the veth's addresses, holding no token and no other set;
a forged read of an unmapped address, or a token holder's stock NIXL WRITE
into the read-only offered region, ends that process, not the daemon, which
serves the next fill.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fleet_nodes import (
    TOKEN,
    checkpoint_digests,
    nixl_missing,
    ready_set,
    receiving,
    serving,
    set_digests,
)

from conftest import SUPPORT, Daemon, wait_until
from engramd.fleet.trust import FleetKey
from engramd.testing.child import JsonLinesChild
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.layout import sets_root
from fleet_lab import UCX_TCP, Net

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")

FORGE = SUPPORT / "nixl_forge.py"
PEER_PORT = 7077
#: Where user space starts to be mapped on Linux (vm.mmap_min_addr's default): nothing is
#: at 0x10000, so a read there faults.
UNMAPPED = 0x10000


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket as `ss -ltnp` shows it."""

    host: str
    port: int
    pids: tuple[int, ...]


def listeners(netns: str) -> list[Listener]:
    """Every listening TCP socket in `netns`, with the pids holding it."""
    out = subprocess.run(
        [*Net.run_in(netns), "ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found = []
    for line in out.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        pids = tuple(sorted({int(p) for p in re.findall(r"pid=(\d+)", line)}))
        found.append(Listener(_unmapped(host.strip("[]")), int(port), pids))
    return found


def _unmapped(host: str) -> str:
    # gRPC listens on an IPv6 socket for an IPv4 address: ss shows ::ffff:10.0.0.1.
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # "*", or an address with an interface
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def scan(netns: str, host: str, *behind: Daemon) -> list[int]:
    """The TCP ports of `host` that accept a connection from `netns` (all 65535 tried).

    `behind`: daemons whose processes yield the CPU to the scan meanwhile (a fill's busy
    transfer processes on this machine's few cores would outlast the fill).
    """
    for d in behind:
        yield_cpu(d.pid)
    out = subprocess.run(
        ["nice", "-n", "-10", *Net.run_in(netns), sys.executable, str(FORGE), "scan", host],
        capture_output=True,
        text=True,
        check=True,
        timeout=50,
    )
    ports: list[int] = json.loads(out.stdout)["open"]
    return ports


def yield_cpu(pid: int) -> None:
    """Every thread of `pid` and of its children at the lowest priority."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
    for child in children(pid):
        yield_cpu(child)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def live_children(pid: int) -> list[int]:
    """The children of `pid` that still run (a zombie holds no socket and no memory)."""
    return [c for c in children(pid) if alive(c)]


def mapped_files(pid: int) -> set[str]:
    """The files process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split()) > 5}


def memory_holds(pid: int, needles: list[bytes]) -> list[bytes]:
    """Those of `needles` found anywhere in the readable memory of process `pid`."""
    found: set[bytes] = set()
    overlap = max(len(n) for n in needles)
    chunk = 16 << 20
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("r") or fields[-1] in ("[vvar]", "[vsyscall]"):
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            for at in range(low, high, chunk):
                try:
                    mem.seek(at)
                    data = mem.read(min(chunk + overlap, high - at))
                except OSError:
                    break  # a region that cannot be read through mem (a device's)
                found.update(n for n in needles if n in data)
    return sorted(found)


class Attacker(JsonLinesChild):
    """tests/support/nixl_forge.py's agent in a namespace, UCX over its veth only."""

    def __init__(self, netns: str, toward: str, log: Path) -> None:
        with open(log, "ab") as err:
            super().__init__(
                [*Net.run_in(netns), sys.executable, str(FORGE), "agent", toward],
                env={**os.environ, **UCX_TCP},
                stderr=err,
            )
        #: pid, ip, port, buffer, secret_at, secret.
        self.hello = self.read()

    def command(self, *words: object) -> dict[str, Any]:
        """One command line of `words`; its answer."""
        return self.ask(" ".join(str(w) for w in words))

    def close(self) -> None:
        """Stop the agent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 42 MB in 32 tables: a fill under --peer-rate 2M lasts about 20 s, and the
    serving daemon looks at its transfer process before each of the 32 grants."""
    return synthesize(
        tmp_path_factory.mktemp("exposure") / "engram", SynthSpec(layers=16, rows=10_000)
    )


@pytest.fixture
def attackers(tmp_path: Path) -> Iterator[Any]:
    """Start attackers: `attackers(netns, toward)`; each is stopped after."""
    started: list[Attacker] = []

    def start(netns: str, toward: str) -> Attacker:
        started.append(Attacker(netns, toward, tmp_path / f"attacker{len(started)}.log"))
        return started[-1]

    yield start
    for a in started:
        a.close()


def ready_ids(d: Daemon) -> set[str]:
    """The ids of the daemon's ready sets."""
    return {s.set_id for s in d.status().sets if s.state == "ready"}


def manifest(folder: Path) -> dict[str, Any]:
    """A published set's manifest."""
    doc: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    return doc


def reading(d: Daemon) -> bool:
    """Whether the daemon's set is filling from a peer, and bytes have landed."""
    return any(s.bytes_loaded > 0 and s.source.startswith("peer") for s in d.status().sets)


def transfer_processes(d: Daemon, netns: str) -> dict[int, list[Listener]]:
    """The daemon's children that listen in `netns`, with what each listens on."""
    kids = set(children(d.pid))
    found: dict[int, list[Listener]] = {}
    for sock in listeners(netns):
        for pid in kids.intersection(sock.pids):
            found.setdefault(pid, []).append(sock)
    return found


# -- between fills ------------------------------------------------------------------------


def test_nothing_listens_between_fills(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """Before a fill and after one, a scan of every port of A's address finds the ports A was
    given and nothing else; of B's (--peers only), nothing; neither daemon listens elsewhere."""
    a, b = nodes("a"), nodes("b")
    health, metrics = PEER_PORT + 1, PEER_PORT + 2
    ra = serving(
        a,
        checkpoint,
        net,
        token_file,
        *("--health-port", str(health), "--health-address", net.ip_a),
        *("--metrics-port", str(metrics), "--metrics-address", net.ip_a),
    )
    configured = [PEER_PORT, health, metrics]
    assert scan(net.b, net.ip_a) == configured
    assert sorted((s.host, s.port) for s in listeners(net.a)) == [(net.ip_a, p) for p in configured]
    assert {s.pids for s in listeners(net.a)} == {(ra.pid,)}

    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:{PEER_PORT}", rb.log
    # The fill's transfer processes end with it (A's once the stream's end reaches it);
    # each daemon keeps one spare for the next fill, which listens nowhere.
    wait_until(
        lambda: all(
            len(live_children(d.pid)) <= 1 and not transfer_processes(d, ns)
            for d, ns in ((ra, net.a), (rb, net.b))
        ),
        15,
        "the fill's end",
    )
    assert scan(net.b, net.ip_a) == configured
    assert sorted((s.host, s.port) for s in listeners(net.a)) == [(net.ip_a, p) for p in configured]
    assert scan(net.a, net.ip_b) == []
    assert listeners(net.b) == []


# -- during a fill ------------------------------------------------------------------------


def test_during_a_fill_only_the_transfer_processes_listen(
    net: Net, nodes: Any, big_checkpoint: Path, checkpoint: Path, token_file: Path
) -> None:
    """While B fills from A, the UCX listeners are the transfer processes' (the daemons'
    children), on the veth's addresses only; the serving one holds no token and maps only
    the served set, not the other set A holds; the receiving one only its landing ring,
    none of the staged set (the daemon moves the landed windows there)."""
    a, b = nodes("a"), nodes("b")
    ra = serving(
        a, big_checkpoint, net, token_file, "--checkpoint", str(checkpoint), "--peer-rate", "2M"
    )
    served, other = plan_tables(big_checkpoint).set_id, plan_tables(checkpoint).set_id
    wait_until(lambda: ready_ids(ra) == {served, other}, 60, "A's two sets")
    rb = receiving(b, big_checkpoint, net, token_file)
    wait_until(lambda: reading(rb), 60, "B to read from A")

    # The daemons themselves: A on its peer port only, B on nothing.
    assert [(s.host, s.port) for s in listeners(net.a) if ra.pid in s.pids] == [
        (net.ip_a, PEER_PORT)
    ]
    assert [s for s in listeners(net.b) if rb.pid in s.pids] == []
    serve, recv = transfer_processes(ra, net.a), transfer_processes(rb, net.b)
    assert len(serve) == 1 and len(recv) == 1, (serve, recv)
    # Every listener of either namespace: A's peer port, or a transfer process on the veth.
    assert sorted(listeners(net.a), key=lambda s: s.port) == sorted(
        [Listener(net.ip_a, PEER_PORT, (ra.pid,)), *next(iter(serve.values()))],
        key=lambda s: s.port,
    )
    assert {s.host for s in next(iter(serve.values()))} == {net.ip_a}
    assert listeners(net.b) == next(iter(recv.values()))
    assert {s.host for s in listeners(net.b)} == {net.ip_b}

    token = TOKEN.encode()
    # What the daemons keep of the token: the keys derived from it (trust.FleetKey).
    keys = list(FleetKey(TOKEN)._keys.values())
    secrets = [token, token.hex().encode(), *keys, *(k.hex().encode() for k in keys)]
    # The search finds a secret where it is: in the daemon, which proves and checks with it.
    assert memory_holds(ra.pid, keys)
    for pid in [*serve, *recv]:
        assert memory_holds(pid, secrets) == [], pid

    served_dir = sets_root(a.shm_dir) / served
    served_files = {str(served_dir / t["file"]) for t in manifest(served_dir)["tensors"]}
    serving_maps = mapped_files(next(iter(serve)))
    assert {f for f in serving_maps if f.startswith(str(a.shm_dir))} == served_files
    for f in serving_maps:
        assert other not in f and str(big_checkpoint) not in f and str(checkpoint) not in f, f
    receiving_maps = mapped_files(next(iter(recv)))
    assert not {f for f in receiving_maps if f.startswith(str(b.shm_dir))}, receiving_maps
    assert {f for f in receiving_maps if f.startswith("/memfd:")} == {
        "/memfd:engramd-landing (deleted)"
    }, receiving_maps
    # The daemon maps the staged set, read-only, to digest what it moved there.
    staged = {f for f in mapped_files(rb.pid) if f.startswith(str(b.shm_dir))}
    assert len(staged) == len(served_files), staged
    assert all(Path(f).parent.name.startswith(f"{served}.loading-") for f in staged), staged


# -- forged metadata ------------------------------------------------------------------------


def test_the_forge_reads_memory_no_one_registered(net: Net, attackers: Any) -> None:
    """The forge is right: between two agents of the attacker's own, in two namespaces, its
    forged metadata READs bytes the target never registered, and a READ of an unmapped
    address kills the target (SIGSEGV)."""
    target = attackers(net.a, net.ip_b)
    attacker = attackers(net.b, net.ip_a)
    assert scan(net.b, net.ip_a) == [target.hello["port"]]
    forged = attacker.command("forge", net.ip_a, target.hello["port"])
    assert "remote" in forged, forged
    read = attacker.command("read", forged["remote"], target.hello["secret_at"], 32)
    assert read == {"state": "DONE", "data": target.hello["secret"]}
    attacker.command("read", forged["remote"], UNMAPPED, 8)
    assert target.proc.wait(timeout=30) == -signal.SIGSEGV


def test_a_forged_read_ends_the_transfer_process_not_the_daemon(
    net: Net, nodes: Any, slow_checkpoint: Path, token_file: Path, attackers: Any
) -> None:
    """During B's fill, every port of A's address but the peer port is attacked with forged
    metadata and a READ of an unmapped address: the serving transfer process dies of SIGSEGV,
    A lives and says so; B asks A again and finishes its fill from a new transfer process, and
    A serves the next fill of the same set from its copy."""
    attacker = attackers(net.b, net.ip_a)
    a, b = nodes("a"), nodes("b")
    ra = serving(a, slow_checkpoint, net, token_file, "--peer-rate", "2M")
    rb = receiving(b, slow_checkpoint, net, token_file)
    wait_until(lambda: reading(rb), 60, "B to read from A")
    serve = transfer_processes(ra, net.a)

    targets = [p for p in scan(net.b, net.ip_a, ra, rb) if p != PEER_PORT]
    assert targets, "no UCX listener during the fill"
    for port in targets:
        forged = attacker.command("forge", net.ip_a, port)
        assert "remote" in forged, forged
        attacker.command("read", forged["remote"], UNMAPPED, 8)
    assert ra.proc is not None and ra.proc.poll() is None, ra.log
    # What the attacker reached was the serving transfer process, and only that.
    assert targets == sorted(s.port for found in serve.values() for s in found), serve
    wait_until(lambda: not any(alive(pid) for pid in serve), 30, "the transfer process to end")
    wait_until(lambda: "ended (killed by SIGSEGV); fill ended" in ra.log, 30, "A to see it")
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:{PEER_PORT}", rb.log
    assert f"peer {net.ip_a}:{PEER_PORT} joined the fill" in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(slow_checkpoint)

    b2 = nodes("b2")
    rb2 = receiving(b2, slow_checkpoint, net, token_file)
    s = ready_set(rb2)
    assert s.source == f"peer {net.ip_a}:{PEER_PORT}", rb2.log
    assert set_digests(b2.shm_dir, s.set_id) == checkpoint_digests(slow_checkpoint)
    assert ra.proc.poll() is None
    # B's first stream, B's stream after the attack, B2's.
    assert ra.log.count("filling set") == 3


def test_a_filling_node_attacked_from_the_network_publishes_the_checkpoints_bytes(
    net: Net, nodes: Any, slow_checkpoint: Path, token_file: Path, attackers: Any
) -> None:
    """B fills from A and serves the pieces it verified on its own peer port. From A's
    namespace, a token holder opens a fill of B's filling set and WRITEs into the offered
    region with stock NIXL: B's serving transfer process dies, not B. Then every other port
    of B's address is attacked with forged metadata and a READ of an unmapped address: they
    are its receiving transfer process's, which dies too. B lives, says why, starts another
    (new ports the attack never saw), keeps the pieces it verified, and publishes exactly the
    checkpoint's bytes, all from A."""
    attacker = attackers(net.a, net.ip_b)
    a, b = nodes("a"), nodes("b")
    ra = serving(a, slow_checkpoint, net, token_file, "--peer-rate", "2M")
    rb = receiving(b, slow_checkpoint, net, token_file, "--peer-listen", f"{net.ip_b}:{PEER_PORT}")
    set_id = plan_tables(slow_checkpoint).set_id
    wait_until(lambda: reading(rb), 60, "B to read from A")
    # B offers its set from its first verified piece on.
    opened: dict[str, Any] = {}

    def offered() -> bool:
        opened.update(attacker.command("fill", f"{net.ip_b}:{PEER_PORT}", TOKEN, set_id))
        return "regions" in opened

    wait_until(offered, 60, "B to offer its filling set")
    # B's two transfer processes: the one its fill reads with maps the landing ring, the one
    # that serves maps B's staged set, read-only, and nothing else of B's.
    landing = "/memfd:engramd-landing (deleted)"
    processes = transfer_processes(rb, net.b)
    receivers = [p for p in processes if landing in mapped_files(p)]
    assert len(processes) == 2 and len(receivers) == 1, (processes, receivers, rb.log)
    (receiver,) = receivers
    (server,) = set(processes) - {receiver}
    staged = {f for f in mapped_files(server) if f.startswith(str(b.shm_dir))}
    assert staged and all(".loading-" in f for f in staged), staged
    address, nbytes = opened["regions"][0]
    attacker.command("write", opened["remote"], address, min(nbytes, 4096))
    wait_until(lambda: not alive(server), 30, "B's serving process to end")
    assert rb.proc is not None and rb.proc.poll() is None, rb.log
    assert alive(receiver)

    targets = [p for p in scan(net.a, net.ip_b, ra, rb) if p != PEER_PORT]
    listening = transfer_processes(rb, net.b)
    assert targets == sorted(s.port for s in listening.get(receiver, [])), (listening, rb.log)
    for port in targets:
        forged = attacker.command("forge", net.ip_b, port)
        assert "remote" in forged, forged
        attacker.command("read", forged["remote"], UNMAPPED, 8)
    wait_until(lambda: not alive(receiver), 30, "B's receiving process to end")
    s = ready_set(rb)
    assert rb.proc.poll() is None and ra.proc is not None and ra.proc.poll() is None
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(slow_checkpoint)
    # The fill lost the reads on the wire, not its pieces nor its correctness.
    assert s.source == f"peer {net.ip_a}:{PEER_PORT}", rb.log
    said = (
        r"the receiving transfer process ended \(killed by SIGSEGV\); another takes its place, "
        r"([1-9]\d*) verified pieces kept"
    )
    assert re.search(said, rb.log), rb.log
    assert "loading from the files" not in rb.log


# -- a fleet member ---------------------------------------------------------------------------


def test_a_token_holders_write_ends_the_transfer_process_not_the_daemon(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, attackers: Any
) -> None:
    """A token holder's stock NIXL WRITE into the offered region (with the offer's own
    metadata) faults the read-only mapping in the serving transfer process, which dies of
    SIGSEGV; A lives, its copy unchanged, and serves the next fill."""
    attacker = attackers(net.b, net.ip_a)
    a, b = nodes("a"), nodes("b")
    ra = serving(a, checkpoint, net, token_file)
    set_id = plan_tables(checkpoint).set_id
    opened = attacker.command("fill", f"{net.ip_a}:{PEER_PORT}", TOKEN, set_id)
    assert "regions" in opened, opened
    serve = transfer_processes(ra, net.a)
    address, nbytes = opened["regions"][0]
    attacker.command("write", opened["remote"], address, min(nbytes, 4096))
    assert ra.proc is not None and ra.proc.poll() is None, ra.log
    # What faulted was the serving transfer process.
    assert len(serve) == 1, serve
    wait_until(lambda: not any(alive(pid) for pid in serve), 30, "the transfer process to end")
    ended = attacker.command("window", nbytes)
    assert ended == {
        "code": "UNAVAILABLE",
        "details": "the transfer process ended (killed by SIGSEGV)",
    }
    assert "ended (killed by SIGSEGV); fill ended" in ra.log
    assert set_digests(a.shm_dir, set_id) == checkpoint_digests(checkpoint)

    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:{PEER_PORT}", rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    assert ra.proc.poll() is None
