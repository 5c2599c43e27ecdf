"""`make bench-sglang-file`: SGLang's own `file` PLE backend against engramd's disk-backed copy.

    .venv-sglang/bin/python -m bench.sglang_ple_file [--reps 2] [--gathers 20000]

One TP1 SGLang rank (tests/sglang_plugin/ple_rank.py: SGLang 0.5.23's real
Qwen4ExpNGramEmbedding with `--ple-offload-backend file`, its own loader, on
CPU) starts over the synthetic Qwen4Exp checkpoint of tests/sglang_plugin
(two PLE layers, bf16), its page cache dropped before the weights load:

- SGLang alone (ENGRAMD_SHARE=off), its table folder removed first: a fresh
  sparse file, which its loader fills;
- SGLang alone again: its file populated by the last start, rewritten;
- with the daemon (`--backing disk`), whose copy was written once, at its
  start (shown on its own line), and adopted by a restart before every
  engramd start.

Per start: seconds to build the PLE layers and load the weights, bytes the
rank wrote (dirtied pages of its table files; /proc/self/io write_bytes) and
read from the checkpoint (read_bytes). Then the gather rate: random rows
read by index from SGLang's table file and from the daemon's file, each
mapped as the engine maps it, warm (after a pass over every row) and cold
(its pages evicted first, POSIX_FADV_DONTNEED: the file's share of
drop_caches), in rows per second, the median of three turns in alternating
order. Before the populated start SGLang's file is written back and evicted,
as a reboot finds it (else its pages are still dirty in the page cache and
rewriting them dirties nothing new). On CPU a gather is torch indexing, where
SGLang's GPU gather is a Triton kernel through the host page tables (not run
here).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from engramd.testing.daemon_process import DaemonProcess
from engramd.testing.pagecache import evict
from engramd_shared.layout import tensor_file_name

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "support"))
sys.path.insert(0, str(TESTS))

import tvshim  # noqa: E402, F401 (before anything imports sglang)
from engine_harness import result, small_readahead_disk  # noqa: E402
from sglang_plugin.ple_harness import Model, make_model, run_ple_ranks  # noqa: E402

FILE_ENV = {
    "SGLANG_QWEN4_PLE_FILE_SKIP_DEVICE_CHECK": "1",
    # The trimmer's default budget (8 GiB): it drops nothing of these small tables.
    "SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB": "8",
}


def start(model: Model, env: dict[str, str], work: Path, offload: Path) -> dict[str, float]:
    """One SGLang rank's start with the file backend: its figures."""
    work.mkdir()
    extra = ("--backend", "file", "--offload-dir", str(offload))
    out = result(run_ple_ranks(model, 1, {**env, **FILE_ENV}, work, extra)[0])
    return {
        "start_s": out["build_s"] + out["load_s"],
        "write_bytes": out["write_bytes"],
        "read_bytes": out["read_bytes"],
    }


def gather_rate(path: Path, row_bytes: int, rows: int, gathers: int, cold: bool) -> float:
    """Random rows per second read by index from a table file mapped shared, read-only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mapping = mmap.mmap(fd, rows * row_bytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only: nothing writes through it
        table = torch.frombuffer(mapping, dtype=torch.uint8).view(rows, row_bytes)
    if not cold:
        table.sum()  # every page in
    ids = torch.randint(0, rows, (gathers,), generator=torch.Generator().manual_seed(1))
    began = time.perf_counter()
    for chunk in ids.split(2048):
        table.index_select(0, chunk)
    rate = gathers / (time.perf_counter() - began)
    del table
    mapping.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--gathers", type=int, default=20_000)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="engramd-bench-ple-file-", dir="/tmp"))
    figures: dict[str, list[dict[str, float]]] = {"fresh": [], "populated": [], "engramd": []}
    with small_readahead_disk(base) as disk:
        model = make_model((disk or base) / "qwen4exp", "bf16")
        sock, tables, offload = base / "s", base / "tables", base / "sglang-ple"
        sock.mkdir()
        tables.mkdir()
        serve = ["--backing", "disk", "--disk-dir", str(tables), "--checkpoint", str(model.folder)]
        daemon = DaemonProcess(sock / "d.sock", base / "shm", serve, sock / "daemon.log").start()
        [first] = daemon.status().sets
        daemon.stop()
        for rep in range(args.reps):
            shutil.rmtree(offload, ignore_errors=True)
            off = {"ENGRAMD_SHARE": "off"}
            figures["fresh"].append(start(model, off, base / f"fresh{rep}", offload))
            evict(offload)
            figures["populated"].append(start(model, off, base / f"populated{rep}", offload))
            daemon.start()
            try:
                env = {"ENGRAMD_SOCKET": str(daemon.socket)}
                figures["engramd"].append(start(model, env, base / f"engramd{rep}", offload))
            finally:
                daemon.stop()
        ours = sorted((tables / "engramd").glob(f"*/{tensor_file_name(0)}"))[0]
        theirs = sorted(offload.rglob("*.bin"))[0]
        row_bytes = model.width * 2
        rows = min(ours.stat().st_size, theirs.stat().st_size) // row_bytes
        turns: dict[str, list[float]] = {}
        for turn in range(3):
            ways = (("sglang", theirs), ("engramd", ours))
            for who, path in ways if turn % 2 == 0 else ways[::-1]:
                for state in ("warm", "cold"):
                    rate = gather_rate(path, row_bytes, rows, args.gathers, state == "cold")
                    turns.setdefault(f"{who}_{state}", []).append(rate)
        rates = {k: statistics.median(v) for k, v in turns.items()}
    shutil.rmtree(base, ignore_errors=True)
    median = {
        way: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for way, runs in figures.items()
    }
    mib = model.table_bytes / 2**20
    print(f"tables {mib:.1f} MiB; the daemon's one load {first.load_seconds:.3f} s")
    print(f"{'start':22} {'seconds':>9} {'written MiB':>12} {'ckpt read MiB':>14}")
    for way, m in median.items():
        print(
            f"{way:22} {m['start_s']:9.3f} {m['write_bytes'] / 2**20:12.2f} "
            f"{m['read_bytes'] / 2**20:14.2f}"
        )
    for state in ("warm", "cold"):
        s, e = rates[f"sglang_{state}"], rates[f"engramd_{state}"]
        print(f"gather {state:5} rows/s  SGLang file {s:12.0f}  engramd {e:12.0f}  {e / s:6.2f}x")
    out = Path(__file__).parent / "results" / "sglang_ple_file.json"
    out.write_text(
        json.dumps(
            {
                "table_bytes": model.table_bytes,
                "daemon_load_s": first.load_seconds,
                **median,
                "gathers": rates,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
