"""A fleet's fill time against its size, by simulation (tests/support/fleetsim.py, driven by
the daemon's schedule, engramd/fleet/swarm.py).

    python -m bench.fleetsim [--nodes 10,100,1000,10000] [--gbit 100,400]

One warm node, an object store serving STORE_GBPS in all, N cold nodes
started together, DeepSeek-V4.1-Flash's 189 GiB of tables in 256 pieces; for
each link speed the time one cold node takes alone and the time until the
last of N is ready. Writes bench/results/fleetsim.json and, with matplotlib,
bench/results/fleetsim.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# The fleet's network fixtures live with the tests (tests/support), as the engine benches'
# harnesses do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from fleetsim import Fleet, simulate

from .common import pyplot, save_plot

#: The object store's aggregate rate, bytes a second (200 Gb/s for the whole fleet).
STORE_GBPS = 25.0
#: The set: DeepSeek-V4.1-Flash's Engram tables.
SET_BYTES = 189 << 30
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="10,100,1000,10000")
    parser.add_argument("--gbit", default="100,400")
    parser.add_argument("--out", type=Path, default=RESULTS / "fleetsim.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print("link     nodes  one node  fleet     ratio  warm  peers  store  files  (simulated in)")
    for gbit in (float(g) for g in args.gbit.split(",")):
        link = gbit * 1e9 / 8
        base = Fleet(nodes=1, link=link, store_rate=STORE_GBPS * 1e9, set_bytes=SET_BYTES)
        one = simulate(base).fleet_seconds
        for nodes in (int(n) for n in args.nodes.split(",")):
            started = time.monotonic()
            got = simulate(Fleet(nodes, link, base.store_rate, SET_BYTES))
            moved = sum(got.served.values())
            share = {k: v / moved for k, v in got.served.items()}
            row = {
                "gbit": gbit,
                "nodes": nodes,
                "one_node_s": round(one, 1),
                "fleet_s": round(got.fleet_seconds, 1),
                "ratio": round(got.fleet_seconds / one, 2),
                "served": {k: round(v, 4) for k, v in share.items()},
            }
            rows.append(row)
            print(
                f"{gbit:>4.0f} Gb/s {nodes:>6}  {one:7.1f} s {got.fleet_seconds:7.1f} s  "
                f"{row['ratio']:5.2f}x {share['warm']:5.3f} {share['peers']:6.3f} "
                f"{share['store']:6.3f} {share['files']:6.3f}  "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    doc = {"store_gbps": STORE_GBPS, "set_bytes": SET_BYTES, "model": Fleet.__doc__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    _plot(rows, args.out.with_suffix(".png"))
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for gbit in sorted({r["gbit"] for r in rows}):
        mine = [r for r in rows if r["gbit"] == gbit]
        ax.plot(
            [r["nodes"] for r in mine],
            [r["fleet_s"] for r in mine],
            marker="o",
            label=f"{gbit:.0f} Gb/s: fleet",
        )
        ax.axhline(mine[0]["one_node_s"], linestyle=":", color=ax.lines[-1].get_color())
        ax.axhline(
            2 * mine[0]["one_node_s"],
            linestyle="--",
            color=ax.lines[-1].get_color(),
            alpha=0.5,
        )
    ax.set_xscale("log")
    ax.set_xlabel("cold nodes filling at once (one warm node, a 200 Gb/s bucket)")
    ax.set_ylabel("seconds until the last is ready")
    ax.set_title("189 GiB of tables across a fleet (dotted: one node; dashed: 2x)")
    save_plot(fig, ax, path)


if __name__ == "__main__":
    sys.exit(main())
