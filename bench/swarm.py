"""A cold fleet filling at once from one warm node, against one cold node alone on the same links
(bench section "swarm").

Six namespaces on a bridge (fleet_lab.bridged), each link limited to
200 Mbit/s both ways with tc, so the links and not this host's 2 cores are the limit (at
400 Mbit/s the fleet's turn kept the 2 cores 70-100% busy):
node 0 is warm (it loaded the set from its files and serves it); in each turn a fresh
daemon on node 1 fills the set alone, then fresh daemons on nodes 1-5 start together and
fill it from the warm node and from each other. Each side's time is wall time from the
daemons' start to the last one's set being ready (the daemons' start is in both); the
warm node's share is what its link sent over what the fleet's sets hold. A worker on the
warm node attaches to its set again and again, before the turns (idle) and during each
fleet's fill (serving): the attach's median and 99th percentile, serving against idle.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engramd_shared.checkpoint import plan_tables

# The fleet's network fixtures live with the tests (tests/support), as the engine benches'
# harnesses do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from fleet_lab import Lan, bridged, netns_missing

from .attach import attach_once
from .common import Figure, compare, percentile
from .fleet import TOKEN, netns_daemon

#: Cold nodes of the fleet, beside the one warm node.
COLD = 5
#: Attaches on the warm node while it is idle.
IDLE_ATTACHES = 20
#: Seconds between two attaches on the warm node.
ATTACH_EVERY_S = 0.05
#: Each link's rate both ways.
LINK = "200mbit"
PEER_PORT = 7077


def _member(lan: Lan, ckpt: Path, token: Path, k: int) -> list[str]:
    return [
        *("--checkpoint", str(ckpt), "--peer-token-file", str(token)),
        *("--peer-listen", f"{lan.ips[k]}:{PEER_PORT}"),
        *("--peers", ",".join(f"{ip}:{PEER_PORT}" for ip in lan.ips)),
    ]


def _ready(daemons: list[Any]) -> list[Any]:
    """Each daemon's set once every one is ready (raises on a failed or a slow one)."""
    deadline = time.monotonic() + 600
    while True:
        found = []
        for d in daemons:
            sets = d.status().sets
            if sets and sets[0].state == "failed":
                raise RuntimeError(f"the fill failed: {sets[0].error}")
            if sets and sets[0].state == "ready":
                found.append(sets[0])
        if len(found) == len(daemons):
            return found
        if time.monotonic() > deadline:
            raise RuntimeError("the fleet did not fill in 600 s")
        time.sleep(0.05)


def _fill(lan: Lan, ckpt: Path, token: Path, nodes: list[int]) -> tuple[float, int]:
    """Seconds until fresh daemons on `nodes`, started together, all hold the set; and the
    bytes the warm node's link sent meanwhile."""
    sent = lan.sent(0)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        daemons = [
            stack.enter_context(
                netns_daemon(
                    ["--drop-on-exit", *_member(lan, ckpt, token, k)], netns=lan.names[k], wait="no"
                )
            )
            for k in nodes
        ]
        for d in daemons:
            d.wait(serving=False)
        for s, d in zip(_ready(daemons), daemons, strict=True):
            if not s.source.startswith("peer"):
                raise RuntimeError(f"the set came from {s.source}, not peers:\n{d.log}")
        seconds = time.perf_counter() - start
    return seconds, lan.sent(0) - sent


@contextlib.contextmanager
def _warm(lan: Lan, ckpt: Path, token: Path) -> Iterator[Any]:
    with netns_daemon(_member(lan, ckpt, token, 0), netns=lan.names[0], wait="serving") as d:
        _ready([d])
        yield d


@contextlib.contextmanager
def _attaching(ckpt: Path, socket: str, times: list[float]) -> Iterator[None]:
    """Attach to the warm node's set over and over on a thread, each time into `times`."""
    stop = threading.Event()

    def attach() -> None:
        # A worker's pace, not a loop that would take a core from the fills it measures.
        while not stop.wait(ATTACH_EVERY_S):
            times.append(attach_once(ckpt, socket))

    thread = threading.Thread(target=attach, name="bench-attach")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def swarm_fills(ckpt: Path, reps: int) -> list[Figure]:
    """The fleet's fill time against one node's, and the warm node's share of the bytes."""
    missing = netns_missing()
    if missing:
        print(f"  swarm: not measured ({missing})", flush=True)
        return []
    nbytes = plan_tables(ckpt).nbytes
    alone: list[float] = []
    fleet: list[float] = []
    shares: list[float] = []
    idle: list[float] = []
    serving: list[float] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        bridged(f"ebs{os.getpid() % 10000}", 1 + COLD, LINK) as lan,
    ):
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        token.chmod(0o400)
        with _warm(lan, ckpt, token) as warm:
            for _ in range(IDLE_ATTACHES):
                time.sleep(ATTACH_EVERY_S)
                idle.append(attach_once(ckpt, str(warm.socket)))
            for turn in range(reps):
                alone.append(_fill(lan, ckpt, token, [1])[0])
                with _attaching(ckpt, str(warm.socket), serving):
                    seconds, sent = _fill(lan, ckpt, token, list(range(1, 1 + COLD)))
                fleet.append(seconds)
                shares.append(100 * sent / (COLD * nbytes))
                print(
                    f"  turn {turn + 1}: one node {alone[-1]:.1f} s, {COLD} nodes "
                    f"{fleet[-1]:.1f} s, the warm node sent {shares[-1]:.0f}%",
                    flush=True,
                )
    size = f"{nbytes / 2**30:.2f} GiB"
    return [
        compare(
            f"{COLD} cold nodes at once from 1 warm, each other ({size}, {LINK} links)",
            "s",
            fleet,
            alone,
            higher_is_better=False,
            target="the fleet within 2x one node (>= 0.5x)",
            at_least=0.5,
            paired=True,
            note="baseline: one cold node alone from the warm node, the same links",
        ),
        compare(
            f"what the warm node sent of the {COLD} nodes' sets",
            "%",
            shares,
            None,
            higher_is_better=False,
            target="< 50%",
            at_most=50.0,
        ),
        *(
            compare(
                f"attach {name} on the warm node while it serves the fleet",
                "ms",
                [1e3 * percentile(serving, q)],
                [1e3 * percentile(idle, q)],
                higher_is_better=False,
                note=f"baseline: idle; {len(serving)} attaches serving, {len(idle)} idle",
            )
            for name, q in (("p50", 50), ("p99", 99))
        ),
    ]
