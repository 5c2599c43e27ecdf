"""The TCP ports as anyone on the network meets them, and what a fill costs the receiver's disk.

Real daemons in network namespaces of their own (as tests/daemon/test_fleet.py
makes them); every attack runs from the other namespace, in a process of its
own (tests/support): a token holder asking for windows beyond its offer or
booking the rate cap and hanging up, token-less Fill streams and Health Watch
streams by the thousand, idle HTTP connections to the metrics port. A peer
fill is then measured by what it brought of the receiver's own checkpoint
into the page cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_harness import drop_cache
from fleet_nodes import TOKEN, nixl_missing, ready_set, receiving, serving

from conftest import SUPPORT, wait_until
from engramd.api.metrics import CONNECTIONS_PER_ADDRESS
from engramd.api.sockets import REQUEST_TIMEOUT_S
from engramd.fleet.base import WINDOW_BYTES
from engramd.fleet.grants import SERVE_SLOTS
from engramd.strong import set_pieces
from engramd.testing.child import JsonLinesChild
from engramd.testing.pagecache import cached
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from fleet_lab import Net, free_port

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")

#: The attacker's calls: 3,000 of them, as the review opened.
FLOOD = 3000


def _in(netns: str, script: str, *args: str, timeout: float = 180) -> dict[str, Any]:
    """A support script run in `netns`; its one JSON line."""
    done = subprocess.run(
        [*Net.run_in(netns), sys.executable, str(SUPPORT / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return doc


def _tcp_connections(pid: int, port: int) -> int:
    """The daemon's open TCP connections on its `port`, as its own namespace lists them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    held = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        listening = fields[3] == "0A"
        if int(fields[1].split(":")[1], 16) == port and not listening and fields[9] in inodes:
            held += 1
    return held


def anonymous_rss(pid: int) -> int:
    """Bytes of a process's anonymous memory in RAM (RssAnon): its heaps and stacks, what a
    held call costs. Not its RSS, which also counts the set's pages once --mlock has mapped
    them (a 42 MB step at a moment of its own after the set is ready)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


class Peak:
    """The most a process's anonymous memory and thread count reached while sampled (on a
    thread)."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.rss = self.threads = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.rss = max(self.rss, anonymous_rss(self._process.pid))
            self.threads = max(self.threads, self._process.num_threads())

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


# -- the rate cap (item 5) ----------------------------------------------------------------


def test_windows_beyond_the_offer_are_refused_and_unused_bookings_return(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """A token holder asks for 2**64-1 bytes, more than WINDOW_BYTES, more than the set; then
    books the rate cap 30 times over and hangs up: a real receiver still fills from the peer."""
    a, b = nodes("a"), nodes("b")
    # 10 MB/s: one booking of the ~42 MB set holds the cap for about 4 s, 30 for ~2 minutes,
    # past the receiver's 60 s without a grant.
    ra = serving(a, big_checkpoint, net, token_file, "--peer-rate", "10M")
    s = ready_set(ra)
    address = f"{net.ip_a}:7077"
    sizes = [2**64 - 1, WINDOW_BYTES + 1, s.bytes + 1]
    refused = _in(net.b, "peer_windows.py", address, TOKEN, s.set_id, "refuse", *map(str, sizes))
    assert len(refused["codes"]) == 3
    for code in refused["codes"]:
        assert code.startswith("INVALID_ARGUMENT: a window of"), refused
        assert f"windows are 1 to {WINDOW_BYTES} bytes" in code
    assert f"a window of {2**64 - 1} bytes: windows are 1 to {WINDOW_BYTES} bytes" in ra.log
    stacked = _in(net.b, "peer_windows.py", address, TOKEN, s.set_id, "stack", "30")
    assert stacked == {"granted": 1, "booked": 30, "bytes": s.bytes}
    rb = receiving(b, big_checkpoint, net, token_file)
    got = ready_set(rb)
    assert got.source == f"peer {address}", rb.log
    assert ra.proc is not None and ra.proc.poll() is None


def test_pieces_past_the_set_are_refused_and_held_slots_free_again(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """A token holder asks for pieces past the set's last: refused. It then takes every serving
    slot with grants it never reads, and from a second stream says `done` for them, which
    frees none: every piece is busy for others. A real receiver fills all the same, once the
    grants are older than GRANT_HOLD_S."""
    a, b = nodes("a"), nodes("b")
    ra = serving(a, big_checkpoint, net, token_file)
    s = ready_set(ra)
    address = f"{net.ip_a}:7077"
    count = len(set_pieces([t.nbytes for t in plan_tables(big_checkpoint).tensors]))
    assert count > SERVE_SLOTS
    refused = _in(
        net.b, "peer_pieces.py", address, TOKEN, s.set_id, "refuse", str(count), "4294967295"
    )
    for piece, code in zip((count, 2**32 - 1), refused["codes"], strict=True):
        assert code.startswith(f"INVALID_ARGUMENT: piece {piece}: set "), refused
        assert f"has pieces 0 to {count - 1}" in code
    hog = JsonLinesChild(
        [
            *Net.run_in(net.b),
            *(sys.executable, str(SUPPORT / "peer_pieces.py")),
            *(address, TOKEN, s.set_id, "hog"),
        ]
    )
    try:
        held = hog.read()
        assert (held["granted"], held["busy"]) == (SERVE_SLOTS, count - SERVE_SLOTS), held
        assert held["second"] == ["busy"] * count, held
        rb = receiving(b, big_checkpoint, net, token_file)
        got = ready_set(rb)
        assert got.source == f"peer {address}", rb.log
        assert ra.proc is not None and ra.proc.poll() is None
    finally:
        assert hog.proc.stdin is not None
        hog.proc.stdin.close()
        hog.proc.wait(timeout=30)


# -- the TCP ports (item 6) ---------------------------------------------------------------


def test_token_less_fill_streams_and_watches_end_and_leave_nothing_behind(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """3,000 Fill streams that send nothing and 3,000 Health Watch streams, from the other
    namespace: each ends within the first-request deadline (or at once), the daemon's memory
    and connections come back down, and a real fill and a probe's Check still work."""
    a, b = nodes("a"), nodes("b")
    health = free_port()
    ra = serving(
        a,
        big_checkpoint,
        net,
        token_file,
        *("--idle-timeout", "2", "--health-port", str(health), "--health-address", net.ip_a),
    )
    ready_set(ra)
    assert ra.proc is not None
    pid = ra.proc.pid
    before = anonymous_rss(pid)
    peak = Peak(pid)
    try:
        fills = _in(net.b, "tcp_flood.py", f"{net.ip_a}:7077", "fill", str(FLOOD), "30")
        watches = _in(net.b, "tcp_flood.py", f"{net.ip_a}:{health}", "watch", str(FLOOD), "30")
    finally:
        peak.stop()
    # Every call was ended by the daemon: a deadline for the first message, a cap on calls in
    # flight (the rest waited in gRPC's queue, then were refused), connections closed under
    # the calls they had queued; Watch is not served on TCP.
    assert fills["held"] == 0 and sum(fills["codes"].values()) == FLOOD, fills
    assert set(fills["codes"]) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
    assert fills["codes"].get("DEADLINE_EXCEEDED", 0) > 0, fills
    assert watches["held"] == 0 and sum(watches["codes"].values()) == FLOOD, watches
    assert set(watches["codes"]) <= {"UNIMPLEMENTED", "UNAVAILABLE"}, watches
    assert watches["codes"].get("UNIMPLEMENTED", 0) > 0, watches
    # Idle connections closed after --idle-timeout; the calls' memory went with them.
    wait_until(
        lambda: _tcp_connections(pid, 7077) + _tcp_connections(pid, health) == 0,
        60,
        "the daemon to close the flood's connections",
    )
    after = anonymous_rss(pid)
    # Measured here (anonymous memory): +10 MB at the peak and after (the allocators keep
    # what they took); the review saw a27fef5 grow by 125 MB and keep it. The bounds leave
    # 2-3x of what was measured, and a27fef5's growth is 4x beyond them.
    assert peak.rss - before < 32 << 20, (before, peak.rss)
    assert after - before < 24 << 20, (before, after)
    checks = _in(net.b, "tcp_flood.py", f"{net.ip_a}:{health}", "check", "5", "1")
    assert checks["codes"] == {"SERVING": 5}, checks
    rb = receiving(b, big_checkpoint, net, token_file)
    assert ready_set(rb).source == f"peer {net.ip_a}:7077", rb.log


def test_idle_http_connections_to_the_metrics_port_take_no_threads(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """300 idle connections from the other namespace: no thread each, each address holds a few,
    each is closed after the request deadline, and /metrics answers another address meanwhile."""
    a = nodes("a")
    port = free_port()
    ra = serving(
        a,
        big_checkpoint,
        net,
        token_file,
        *("--metrics-port", str(port), "--metrics-address", net.ip_a),
    )
    ready_set(ra)
    assert ra.proc is not None
    pid = ra.proc.pid
    threads = psutil.Process(pid).num_threads()
    holder = subprocess.Popen(
        [
            *Net.run_in(net.b),
            sys.executable,
            str(SUPPORT / "tcp_hold.py"),
            net.ip_a,
            str(port),
            "300",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert json.loads(holder.stdout.readline()) == {"connected": 300}
        assert psutil.Process(pid).num_threads() <= threads + 2
        # A scrape from another address (namespace a's own) is answered meanwhile.
        scrape = subprocess.run(
            [
                *Net.run_in(net.a),
                sys.executable,
                "-c",
                "import sys, urllib.request; "
                f"r = urllib.request.urlopen('http://{net.ip_a}:{port}/metrics', timeout=10); "
                "sys.stdout.write(r.headers['Content-Type'] + '\\n' + r.read().decode())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert scrape.returncode == 0, scrape.stderr
        assert scrape.stdout.startswith("text/plain; version=0.0.4")
        assert "engramd_ready 1.0" in scrape.stdout
        # The idle ones: all but a few closed at once, those after the request deadline.
        assert _tcp_connections(pid, port) <= CONNECTIONS_PER_ADDRESS
        wait_until(
            lambda: _tcp_connections(pid, port) == 0,
            10 * REQUEST_TIMEOUT_S,
            "the daemon to close the idle connections",
        )
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == {"closed": 300}
    finally:
        holder.kill()
        holder.wait(30)
    assert psutil.Process(pid).num_threads() <= threads + 2
    with pytest.raises(urllib.error.URLError):
        # Bound to the namespace's address only: nothing of it listens on the host's loopback.
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


# -- what a fill reads of the receiver's files ----------------------------------------------


def test_a_peer_fill_reads_next_to_nothing_of_the_receivers_files(
    net: Net, nodes: Any, token_file: Path, tmp_path: Path
) -> None:
    """A `synth --rows 400000` set (two files of 105 MB): the receiver's page cache holds less
    than 5% of the set of its own copy after the fill (headers, fingerprint samples, spot
    checks: measured 0.3%)."""
    theirs = synthesize(tmp_path / "a" / "engram", SynthSpec(rows=400_000))
    mine = tmp_path / "b" / "engram"
    shutil.copytree(theirs, mine)
    a, b = nodes("a"), nodes("b")
    ready_set(serving(a, theirs, net, token_file))
    # Written back first (drop_cache fsyncs): drop_caches and FADV_DONTNEED leave dirty
    # pages, so a file just written stays cached whole, as if a fill had read all of it.
    drop_cache(mine)
    assert cached(mine, "*.safetensors") == 0
    rb = receiving(b, mine, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    read = cached(mine, "*.safetensors")
    assert 0 < read < s.bytes // 20, (read, s.bytes)
