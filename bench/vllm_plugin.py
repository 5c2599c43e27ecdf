"""`make bench-vllm`: vLLM replicas starting with the plugin against vLLM's own CPU-offload path.

    .venv-vllm/bin/python -m bench.vllm_plugin [--replicas 4] [--reps 2] [--ple-rows 200000]
        [--workdir DIR]

For each family of n-gram tables vLLM 0.33.0 ships, N single-rank vLLM
replicas (as N separate TP1 `vllm serve`) build the layers and load a
synthetic checkpoint one after another, on CPU, with only the calls that
need a GPU replaced:

- DeepSeek-V4.1's Engram layers over tests/vllm_plugin's checkpoint
  (tests/vllm_plugin/vllm_rank.py);
- Qwen4Exp's PLE n-gram embeddings (NVFP4, the format Qwen3.8-Flash-Next's
  47.68 GiB fp8 table ships smallest in) over a checkpoint of two PLE layers
  of about --ple-rows rows each in 7 row shards
  (tests/vllm_plugin/vllm_ple_rank.py).

Side by side, alternating: the plugin with the daemon serving, and
ENGRAMD_SHARE=off, where vLLM allocates its own tables (pinned memory
replaced by exact-size pageable memory: real pinned memory rounds each
table up to a power of two, so vLLM's side is understated).

Figures: host memory of the tables for all replicas (the daemon's copy plus
the tables each replica holds itself), bytes each replica read from the
checkpoint's disk (its page cache dropped first), seconds until the layers
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramd.host.hugeroot import remove_shm_folder
from engramd.testing.daemon_process import DaemonProcess

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "support"))
sys.path.insert(0, str(TESTS))

import tvshim  # noqa: E402, F401 (before vLLM imports torchvision)
from engine_harness import result, small_readahead_disk  # noqa: E402
from vllm_plugin.vllm_harness import (  # noqa: E402
    HEAD_DIM,
    PLE_RANK,
    RANK,
    make_model,
    make_ple_model,
)

#: vLLM's model registry inspects the Qwen4Exp class in a subprocess: torchvision there too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS / "support" / "shims"), *filter(None, [os.environ.get("PYTHONPATH")])]
)


@dataclass(frozen=True)
class Family:
    """One family's checkpoint, the rank script that builds its layers, and its tables' bytes."""

    name: str
    folder: Path
    config: Path
    rank: Path
    table_bytes: int
    #: The bytes of the tables a replica holds itself, from its result.
    private_bytes: Callable[[dict[str, Any]], int]


def replicas(family: Family, count: int, env: dict[str, str], work: Path) -> list[dict[str, Any]]:
    """`count` single-rank vLLM replicas, one after another; each one's result.

    One after another: each drops the checkpoint's page cache and counts its
    own reads, which replicas loading at once would share through the cache.
    """
    done = []
    for i in range(count):
        folder = work / f"replica{i}"
        folder.mkdir()
        cmd = [sys.executable, str(family.rank), "0", "1", str(folder / "init"), str(family.config)]
        if env.get("ENGRAMD_SHARE") == "off":
            cmd.append("--private-pin")
        ran = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=900
        )
        done.append(result(ran))
    return done


def engram_private(run: dict[str, Any]) -> int:
    """A replica's own Engram tables: every table vLLM's loader wrote."""
    return sum(
        (info["end"] - info["start"]) * (HEAD_DIM + HEAD_DIM // 32)
        for info in run["layers"].values()
        if not info["served"]
    )


def ple_private(run: dict[str, Any]) -> int:
    """A replica's own PLE tables: the bytes of every part it holds itself."""
    return sum(
        nbytes
        for info in run["layers"].values()
        for part, nbytes in info["nbytes"].items()
        if part not in info["served"]
    )


def summary(family: Family, runs: list[dict[str, Any]], set_bytes: int) -> dict[str, float]:
    """Host memory of the tables (the daemon's copy and every replica's own), reads and
    start time per replica."""
    return {
        "host_table_bytes": set_bytes + sum(family.private_bytes(r) for r in runs),
        "read_bytes_per_replica": statistics.mean(r["read_bytes"] for r in runs),
        "start_s": statistics.median(r["build_s"] + r["load_s"] for r in runs),
    }


def compare(family: Family, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """The family's figures, plugin and vLLM's own side by side (median over reps)."""
    shm = Path(tempfile.mkdtemp(prefix="engramd-bench-vllm-", dir="/dev/shm"))
    sock = Path(tempfile.mkdtemp(prefix="ebv", dir="/tmp"))
    daemon = DaemonProcess(
        sock / "d.sock", shm, ["--checkpoint", str(family.folder)], sock / "daemon.log"
    ).start()
    try:
        set_bytes = sum(s.bytes for s in daemon.status().sets)
        sides: dict[str, list[dict[str, float]]] = {"plugin": [], "vllm": []}
        for rep in range(args.reps):
            for side in ("plugin", "vllm") if rep % 2 == 0 else ("vllm", "plugin"):
                env = {"ENGRAMD_SOCKET": str(daemon.socket)}
                if side == "vllm":
                    env["ENGRAMD_SHARE"] = "off"
                work = base / f"{family.name}-{side}{rep}"
                work.mkdir()
                runs = replicas(family, args.replicas, env, work)
                sides[side].append(summary(family, runs, set_bytes if side == "plugin" else 0))
    finally:
        daemon.stop()
        # And the huge-page tmpfs a daemon run as root mounts there.
        remove_shm_folder(shm)
        shutil.rmtree(sock, ignore_errors=True)
    figures = {
        side: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        for side, reps in sides.items()
    }
    print(f"{family.name}: {args.replicas} replicas, tables {family.table_bytes / 2**20:.1f} MiB")
    print(f"{'figure':28} {'plugin':>14} {'vLLM own':>14} {'ratio':>8}")
    for key in ("host_table_bytes", "read_bytes_per_replica", "start_s"):
        ours, theirs = figures["plugin"][key], figures["vllm"][key]
        ratio = ours / theirs if theirs else float("nan")
        print(f"{key:28} {ours:14.3f} {theirs:14.3f} {ratio:8.3f}")
    return {"table_bytes": family.table_bytes, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ple-rows", type=int, default=200_000, help="rows per PLE head")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="engramd-bench-vllm-", dir=args.workdir or "/tmp"))
    results: dict[str, Any] = {"replicas": args.replicas}
    with small_readahead_disk(base) as disk:
        root = disk or base
        engram = make_model(root / "ckpt")
        ple = make_ple_model(root / "qwen4exp", "NVFP4", args.ple_rows)
        families = (
            Family(
                "engram",
                engram.folder,
                engram.config,
                RANK,
                engram.spec.table_bytes,
                engram_private,
            ),
            Family("ple", ple.folder, ple.config, PLE_RANK, ple.table_bytes, ple_private),
        )
        for family in families:
            results[family.name] = compare(family, args, base)
    out = Path(__file__).parent / "results" / "vllm_plugin.json"
    out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
