"""A fleet fills from each other: pieces from several peers at once, a filling node serving what
it verified, a dead peer costing time and a lying one found by the piece's digest.

The fleet test puts one warm daemon and five cold ones in network namespaces of
their own on a bridge, each link limited to 400 Mbit/s both ways (tc's token
bucket), so the links and not this host's 2 cores are the limit; each cold node
has its own copy of the checkpoint, out of the page cache, and its own address
in its --peers list (a headless Service names every member). How long the
fleet takes against one node alone is the benchmark's (`make bench`, bench/fleet.py).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_harness import drop_cache
from fleet_nodes import (
    Node,
    checkpoint_digests,
    nixl_missing,
    ready_set,
    rogue_peer,
    serving,
    set_digests,
)

from conftest import Worker, wait_until
from engramd.cli.status_view import render
from engramd.testing.pagecache import cached
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.layout import sets_root
from fleet_lab import Lan, Net, bridged, netns_missing
from helpers import reference_digests

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")

#: The fleet: one warm node and this many cold ones.
COLD = 5
PORT = 7077


@pytest.fixture
def lan() -> Iterator[Lan]:
    """One namespace for each node of the fleet on a bridge, links at 400 Mbit/s."""
    missing = netns_missing()
    if missing:
        pytest.skip(f"{missing} (CI runs as root and `make test-tools` installs iproute2)")
    with bridged(f"esw{os.getpid() % 10000}", 1 + COLD, "400mbit") as made:
        yield made


def fleet_member(
    node: Node, checkpoint: Path, lan: Lan, k: int, token: Path, wait: str = "up"
) -> Any:
    """Node `k`'s daemon: it serves peers on its address and fills from every member's."""
    members = ",".join(f"{ip}:{PORT}" for ip in lan.ips)
    return node.start(
        [
            *("--checkpoint", str(checkpoint)),
            *("--peer-listen", f"{lan.ips[k]}:{PORT}", "--peers", members),
            *("--peer-token-file", str(token)),
        ],
        lan.names[k],
        wait=wait,
    )


def test_a_cold_fleet_fills_from_each_other(
    lan: Lan, nodes: Any, token_file: Path, tmp_path: Path
) -> None:
    """One warm node and five cold ones started together: each cold node ready with exactly
    the checkpoint's bytes (its workers' too), having read less than 5% of a local load from
    its own files, and the warm node sent less than half of the bytes the fleet received."""
    # About 240 MiB: 16 pieces, enough for the cold nodes to trade.
    source = synthesize(tmp_path / "warm" / "engram", SynthSpec(rows=480_000))
    warm = nodes("w")
    ready_set(fleet_member(warm, source, lan, 0, token_file, wait="serving"))
    copies = []
    for k in range(1, 1 + COLD):
        mine = tmp_path / f"cold{k}" / "engram"
        shutil.copytree(source, mine)
        copies.append(mine)
    # Written back first: drop_caches leaves dirty pages, as if a fill had read them all.
    for mine in copies:
        drop_cache(mine)
        assert cached(mine, "*.safetensors") == 0
    sent_before = lan.sent(0)
    cold = [nodes(f"c{k}") for k in range(1, 1 + COLD)]
    # Started together: none waits for another to answer.
    daemons = [
        fleet_member(node, mine, lan, k, token_file, wait="no")
        for k, (node, mine) in enumerate(zip(cold, copies, strict=True), start=1)
    ]
    for d in daemons:
        d.wait(serving=False)
    sets = [ready_set(d) for d in daemons]
    read = [cached(mine, "*.safetensors") for mine in copies]
    served = lan.sent(0) - sent_before
    received = sum(s.bytes for s in sets)
    for d, s in zip(daemons, sets, strict=True):
        assert s.source.startswith("peer"), d.log
    for node, s in zip(cold, sets, strict=True):
        assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(source)
    for mine, got, s in zip(copies, read, sets, strict=True):
        assert got < s.bytes // 20, (mine, got, s.bytes)
    assert served < received // 2, (served, received)
    from_cold = 0
    for k, (d, s) in enumerate(zip(daemons, sets, strict=True), start=1):
        # Status says what each peer gave: every verified byte, none from the node itself.
        given = dict(s.bytes_by_source)
        assert sum(given.values()) == s.bytes, given
        assert f"{lan.ips[k]}:{PORT}" not in given
        shown = render(d.status(), width=400)
        first = min(given)
        named = "peer" if len(given) == 1 else "peers"
        assert f"{named} {first} {100 * given[first] // s.bytes}%" in shown, shown
        (line,) = [x for x in d.log.splitlines() if "filled from peers:" in x]
        # A node never asks its own peer port, though its --peers names it.
        assert f" {lan.ips[k]}:{PORT} " not in line, line
        from_cold += sum(n for name, n in given.items() if name != f"{lan.ips[0]}:{PORT}")
    # Status says so too: cold nodes gave more than half of the fleet's bytes, and the files
    # none.
    assert from_cold > received // 2, (from_cold, received)
    assert all("files" not in dict(s.bytes_by_source) for s in sets)
    expected = reference_digests(source)
    for d, mine in zip(daemons, copies, strict=True):
        worker = Worker(mine, d.socket, share="on")
        try:
            assert worker.hello["mode"] == "shared", worker.hello
            assert worker.hello["digests"] == expected
        finally:
            worker.exit()


def two_peers(node: Node, checkpoint: Path, net: Net, token: Path, second: int) -> Any:
    """`node`'s daemon in namespace b, filling from A (port 7077) and the peer at `second`."""
    return node.start(
        [
            *("--checkpoint", str(checkpoint)),
            *("--peers", f"{net.ip_a}:7077,{net.ip_a}:{second}"),
            *("--peer-token-file", str(token)),
        ],
        net.b,
    )


def test_a_peer_killed_mid_fill_costs_time_not_correctness(
    net: Net, nodes: Any, big_checkpoint: Path, token_file: Path
) -> None:
    """B fills from A and A2 at once (each capped at 4 MB/s); A2 is killed mid-fill: B takes
    the rest from A and publishes exactly the checkpoint's bytes; its log names both."""
    a, a2, b = nodes("a"), nodes("a2"), nodes("b")
    ready_set(serving(a, big_checkpoint, net, token_file, "--peer-rate", "4M"))
    second = a2.start(
        [
            *("--checkpoint", str(big_checkpoint), "--peer-listen", f"{net.ip_a}:7079"),
            *("--peer-token-file", str(token_file), "--peer-rate", "4M"),
        ],
        net.a,
        wait="serving",
    )
    ready_set(second)
    rb = two_peers(b, big_checkpoint, net, token_file, 7079)

    def from_a2() -> bool:
        return any(x.bytes_by_source.get(f"{net.ip_a}:7079", 0) for x in rb.status().sets)

    wait_until(from_a2, 60, "B to take a piece from A2")
    second.stop(signal.SIGKILL)
    s = ready_set(rb)
    assert s.source == f"peers {net.ip_a}:7077, {net.ip_a}:7079", rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(big_checkpoint)
    assert f"set {s.set_id}: peer {net.ip_a}:7079: the peer's stream broke mid-fill" in rb.log
    assert f"filled from peers: {net.ip_a}:7077 " in rb.log
    assert no_partial_loads(b.shm_dir)


def test_a_lying_peer_is_found_by_the_piece_and_skipped(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """Among B's peers is a relay that forwards A's genuine offer (digests and attestation)
    but serves a copy with a row zeroed in every piece: the first piece B reads from it
    differs from its attested digest, the relay is dropped, and A gives every piece. A
    grants under --peer-rate 4M, so the relay's first piece lands before A could send the
    same one again (the end game asks A for it too)."""
    a = nodes("a")
    serving(a, checkpoint, net, token_file, "--peer-rate", "4M")
    with rogue_peer(net, checkpoint, 7078, "relay-liar", f"{net.ip_a}:7077") as (rogue, _):
        b = nodes("b")
        rb = two_peers(b, checkpoint, net, token_file, 7078)
        s = ready_set(rb)
        captured = rogue.ask("captured")
    assert "piece" in captured["kinds"]  # B read the liar's bytes
    assert f"set {s.set_id}: peer {net.ip_a}:7078: it sent piece " in rb.log, rb.log
    assert "with another digest than the attested one; dropped" in rb.log
    assert f"filled from peers: {net.ip_a}:7077 100%" in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def test_a_peer_whose_reads_cannot_start_is_left_not_the_fill(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """A relay among B's peers forwards A's genuine offer but names regions its NIXL agent
    never registered (`rogue_peer.py relay-unregistered`): NIXL refuses to start each read
    of it, the relay is left after its failures, and A gives every piece; B's fill goes on
    (before, the first refused read failed the whole fill, and B loaded from its files)."""
    a = nodes("a")
    serving(a, checkpoint, net, token_file, "--peer-rate", "4M")
    with rogue_peer(net, checkpoint, 7078, "relay-unregistered", f"{net.ip_a}:7077") as (
        rogue,
        _,
    ):
        b = nodes("b")
        rb = two_peers(b, checkpoint, net, token_file, 7078)
        s = ready_set(rb)
        captured = rogue.ask("captured")
    assert "piece" in captured["kinds"]  # B was granted pieces of it
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    assert f"filled from peers: {net.ip_a}:7077 100%" in rb.log
    assert "NIXL could not start the read" in rb.log and "loading from the files" not in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def no_partial_loads(shm_dir: Path) -> bool:
    return not any(".loading" in p.name for p in sets_root(shm_dir).iterdir())
