"""A worker that attaches with a CUDA device and checks GPU gathers against the checkpoint.

    python gpu_worker.py CHECKPOINT --socket S [--rounds N]

Prints one JSON line per round ({"ok": true, "mode": ..., "cpu": CPU views
exist, "rows": ...} or the first tensor that differs) and reads a line from
stdin before the next. Run several at once to register (or import) one
shared set in each.
"""

from __future__ import annotations

import argparse
import json

import torch

from engramd_client import Tables, attach
from engramd_shared.errors import NoCpuView


def check(tables: Tables, reference: Tables, seed: int) -> dict[str, object]:
    """Gather 4096 random rows of every tensor on the GPU; compare with the checkpoint's bytes.

    `reference`: the checkpoint read privately on the CPU, so sets without CPU
    views (engramd's cuda-device backing) are checked the same way.
    """
    g = torch.Generator().manual_seed(seed)
    rows = 0
    for name in reference:
        expected = reference[name]
        if expected.numel() == 0:
            continue
        index = torch.randint(0, expected.shape[0], (4096,), generator=g)
        on_gpu = tables.cuda(name).view(torch.uint8).index_select(0, index.cuda())
        if not torch.equal(on_gpu.cpu(), expected.view(torch.uint8).index_select(0, index)):
            return {"ok": False, "tensor": name}
        rows += index.numel()
    return {"ok": True, "rows": rows}


def has_cpu_views(tables: Tables) -> bool:
    """Every tensor is also a CPU tensor (host memory); False for a set in GPU memory."""
    try:
        return all(tables[name] is not None for name in tables)
    except NoCpuView:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    reference = attach(args.checkpoint, share=False)
    with attach(args.checkpoint, socket=args.socket, share=True, device="cuda:0") as tables:
        for seed in range(args.rounds):
            if seed:
                input()
            result = {"mode": tables.mode, "cpu": has_cpu_views(tables)}
            print(json.dumps({**result, **check(tables, reference, seed)}), flush=True)


if __name__ == "__main__":
    main()
