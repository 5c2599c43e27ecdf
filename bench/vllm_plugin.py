"""`make bench-vllm`: vLLM replicas starting with the plugin against vLLM's own CPU-offload path.

    .venv-vllm/bin/python -m bench.vllm_plugin [--replicas 4] [--workdir DIR]

Four single-replica vLLM 0.33.0 ranks (as N separate `vllm serve`) build
DeepSeek-V4.1-shaped Engram layers and load the synthetic checkpoint of
tests/vllm_plugin one after another, on CPU (tests/vllm_plugin/vllm_rank.py; only the
calls that need a GPU are replaced). Side by side, alternating: the plugin
with the daemon serving, and ENGRAMD_SHARE=off, where vLLM allocates its own
tables (pinned memory replaced by exact-size pageable memory: real pinned
memory rounds each table up to a power of two, so vLLM's side is understated).

Figures: host memory of the Engram tables for all replicas (the daemon's
copy plus the tables each replica holds itself), bytes each replica read
from the checkpoint (its page cache dropped first), seconds until the layers
were built and the weights loaded (median over replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from engramd.demo.daemon_process import DaemonProcess

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from engine_harness import result, small_readahead_disk  # noqa: E402
from vllm_plugin.vllm_harness import HEAD_DIM, RANK, Model, make_model  # noqa: E402


def replicas(model: Model, count: int, env: dict[str, str], work: Path) -> list[dict[str, Any]]:
    """`count` single-rank vLLM replicas, one after another; each one's result.

    One after another: each drops the checkpoint's page cache and counts its
    own reads, which replicas loading at once would share through the cache.
    """
    done = []
    for i in range(count):
        folder = work / f"replica{i}"
        folder.mkdir()
        cmd = [sys.executable, str(RANK), "0", "1", str(folder / "init"), str(model.config)]
        if env.get("ENGRAMD_SHARE") == "off":
            cmd.append("--private-pin")
        ran = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=900
        )
        done.append(result(ran))
    return done


def summary(runs: list[dict[str, Any]], set_bytes: int) -> dict[str, float]:
    """Host memory of the tables (the daemon's copy, plus every table a replica holds
    itself: vLLM's loader wrote all of it), reads and start time per replica."""
    private = sum(
        (info["end"] - info["start"]) * (HEAD_DIM + HEAD_DIM // 32)
        for run in runs
        for info in run["layers"].values()
        if not info["served"]
    )
    return {
        "host_table_bytes": set_bytes + private,
        "read_bytes_per_replica": statistics.mean(r["read_bytes"] for r in runs),
        "start_s": statistics.median(r["build_s"] + r["load_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="engramd-bench-vllm-", dir=args.workdir or "/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="engramd-bench-vllm-", dir="/dev/shm"))
    sock = Path(tempfile.mkdtemp(prefix="ebv", dir="/tmp"))
    with small_readahead_disk(base) as disk:
        model = make_model((disk or base) / "ckpt")
        daemon = DaemonProcess(
            sock / "d.sock", shm, ["--checkpoint", str(model.folder)], sock / "daemon.log"
        ).start()
        try:
            set_bytes = sum(s.bytes for s in daemon.status().sets)
            sides: dict[str, list[dict[str, float]]] = {"plugin": [], "vllm": []}
            for rep in range(args.reps):
                for side in ("plugin", "vllm") if rep % 2 == 0 else ("vllm", "plugin"):
                    env = {"ENGRAMD_SOCKET": str(daemon.socket)}
                    if side == "vllm":
                        env["ENGRAMD_SHARE"] = "off"
                    work = base / f"{side}{rep}"
                    work.mkdir()
                    runs = replicas(model, args.replicas, env, work)
                    sides[side].append(summary(runs, set_bytes if side == "plugin" else 0))
        finally:
            daemon.stop()
    figures = {
        side: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        for side, reps in sides.items()
    }
    table_bytes = model.spec.table_bytes
    print(f"{args.replicas} replicas, Engram tables {table_bytes / 2**20:.1f} MiB")
    print(f"{'figure':28} {'plugin':>14} {'vLLM own':>14} {'ratio':>8}")
    for key in ("host_table_bytes", "read_bytes_per_replica", "start_s"):
        ours, theirs = figures["plugin"][key], figures["vllm"][key]
        ratio = ours / theirs if theirs else float("nan")
        print(f"{key:28} {ours:14.3f} {theirs:14.3f} {ratio:8.3f}")
    out = Path(__file__).parent / "results" / "vllm_plugin.json"
    out.write_text(json.dumps({"replicas": args.replicas, "table_bytes": table_bytes, **figures}))
    for folder in (shm, sock, base):
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
