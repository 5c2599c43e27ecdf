"""One replica of `engramd demo`: attach, then run checked Engram lookups on request.

Speaks JSON lines on stdout and takes commands on stdin, so the demo can
run the replicas' lookups one at a time (a fair comparison on a small
machine) and measure their memory while all of them are attached:

  (start)  -> {"mode", "reason", "attach_s", "set_id"}
  run      -> {"lookups", "gather_s", "checked", "bad"}
  exit     -> closes the tables and exits
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from engramd.testing.child import say
from engramd.testing.engram_hash import EngramHash, byte_rows, gather
from engramd.testing.synth import expected_rows
from engramd_client import Tables, attach

VOCAB = 129_280


def run_lookups(tables: Tables, rank: int, steps: int, tokens: int, seed: int) -> dict[str, object]:
    """Gather every layer's rows for `steps` random token streams; check each row."""
    layers = sorted(int(n.split(".")[1]) for n in tables if n.endswith(".engram.embed.weight"))
    weight = {layer: byte_rows(tables[f"layers.{layer}.engram.embed.weight"]) for layer in layers}
    scale = {layer: byte_rows(tables[f"layers.{layer}.engram.embed.scale"]) for layer in layers}
    hashes = {layer: EngramHash(rows=weight[layer].shape[0], layer=layer) for layer in layers}
    heads = hashes[layers[0]].heads
    dim, groups = weight[layers[0]].shape[1], scale[layers[0]].shape[1]
    # Allocated once: a fresh output per call would halve the throughput.
    w_out = torch.empty(tokens * heads, dim, dtype=torch.uint8)
    s_out = torch.empty(tokens * heads, groups, dtype=torch.uint8)
    g = torch.Generator().manual_seed(1_000 + rank)
    gather_s, lookups, checked, bad = 0.0, 0, 0, 0
    for step in range(steps + 1):
        stream = torch.randint(0, VOCAB, (tokens + 2,), generator=g)
        for layer in layers:
            rows = hashes[layer].rows_for(stream).view(-1)
            start = time.perf_counter()
            gather(weight[layer], rows, w_out)
            gather(scale[layer], rows, s_out)
            took = time.perf_counter() - start
            if step:  # step 0 warms caches and page tables; it is checked, not timed
                gather_s += took
                lookups += rows.numel()
            bad += int((w_out != expected_rows(seed, layer, "weight", rows, dim)).any(1).sum())
            bad += int((s_out != expected_rows(seed, layer, "scale", rows, groups)).any(1).sum())
            checked += rows.numel()
    return {"lookups": lookups, "gather_s": gather_s, "checked": checked, "bad": bad}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--share", choices=["auto", "off"], default="auto")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    tables = attach(
        args.checkpoint,
        socket=args.socket,
        share=False if args.share == "off" else None,
        labels={"dp_rank": str(args.rank), "role": "demo"},
    )
    say(
        {
            "mode": tables.mode,
            "reason": tables.reason,
            "set_id": tables.set_id,
            "attach_s": time.perf_counter() - start,
        }
    )
    for line in sys.stdin:
        if line.strip() == "run":
            say(run_lookups(tables, args.rank, args.steps, args.tokens, args.seed))
        elif line.strip() == "exit":
            break
    tables.close()
    return 0


def _quietly() -> int:
    """main(), without a traceback when the demo went away mid-answer (its pipe closed)."""
    try:
        return main()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at nothing so that stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(_quietly())
