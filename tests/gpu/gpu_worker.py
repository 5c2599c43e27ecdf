"""A worker that attaches with a CUDA device and checks GPU gathers against CPU gathers.

    python gpu_worker.py CHECKPOINT --socket S [--rounds N]

Prints one JSON line per round ({"ok": true, "mode": ..., "rows": ...} or the
first tensor that differs) and reads a line from stdin before the next.
Run several at once to register one shared set in each.
"""

from __future__ import annotations

import argparse
import json

import torch

from engramd_client import Tables, attach


def check(tables: Tables, seed: int) -> dict[str, object]:
    """Gather 4096 random rows of every tensor on the GPU and on the CPU; compare bytes."""
    g = torch.Generator().manual_seed(seed)
    rows = 0
    for name in tables:
        cpu = tables[name]
        if cpu.numel() == 0:
            continue
        index = torch.randint(0, cpu.shape[0], (4096,), generator=g)
        on_gpu = tables.cuda(name).view(torch.uint8).index_select(0, index.cuda())
        if not torch.equal(on_gpu.cpu(), cpu.view(torch.uint8).index_select(0, index)):
            return {"ok": False, "tensor": name}
        rows += index.numel()
    return {"ok": True, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with attach(args.checkpoint, socket=args.socket, share=True, device="cuda:0") as tables:
        for seed in range(args.rounds):
            if seed:
                input()
            print(json.dumps({"mode": tables.mode, **check(tables, seed)}), flush=True)


if __name__ == "__main__":
    main()
