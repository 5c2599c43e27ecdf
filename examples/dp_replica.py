"""One data-parallel replica: build the model, attach the node's tables, bind, run a step.

    python examples/dp_replica.py /models/ckpt --rank 0

Every replica of a node maps the one copy the daemon holds; with no daemon
(or ENGRAMD_SHARE=off) it falls back to private tables and computes the same
outputs. Prints one JSON line: how it holds the tables and a digest of its
output.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from engram_layer import TABLE_NAMES, EngramModel
from engramd_client import attach, bind, layer_names, plan_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rank", type=int, default=0, help="data-parallel rank (a label)")
    parser.add_argument("--socket", default=None, help="the daemon's socket")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args()

    model = EngramModel.for_checkpoint(plan_tables(args.checkpoint)).eval()
    with attach(args.checkpoint, socket=args.socket, labels={"dp_rank": str(args.rank)}) as tables:
        bound = bind(model, tables, layer_names(TABLE_NAMES))
        # The same batch in every replica, so their outputs can be compared.
        tokens = torch.randint(
            0, 32_000, (2, args.tokens), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            out = model(tokens)
        digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()
        print(json.dumps({"mode": tables.mode, "bound": len(bound), "digest": digest}))


if __name__ == "__main__":
    main()
