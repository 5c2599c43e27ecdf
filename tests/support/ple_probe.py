"""A worker of the PLE tests: attach a Qwen4Exp checkpoint's PLE tables over row ranges.

    python ple_probe.py CHECKPOINT ROWS_JSON [--socket S] [--share auto|on|off]

ROWS_JSON maps each table to [start, stop) (stop may pass the table's end:
padding). Prints one JSON line: the mode, the checkpoint names served, and
per table its shape, whether its rows hold the checkpoint's bytes, whether
its padding is zero, and where it is mapped (/proc/self/maps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_harness import mapping_of

from engramd.testing.synth import PleSpec, expected_ple_rows
from engramd_client import attach
from engramd_shared.families import PLE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("rows")
    parser.add_argument("--spec", required=True, help="PleSpec fields as JSON")
    parser.add_argument("--socket", default=None)
    parser.add_argument("--share", default="auto")
    args = parser.parse_args()
    fields = json.loads(args.spec)
    spec = PleSpec(
        **{**fields, "layers": tuple(fields["layers"]), "layer_rows": tuple(fields["layer_rows"])}
    )
    rows = {k: tuple(v) for k, v in json.loads(args.rows).items()}
    share = {"auto": None, "on": True, "off": False}[args.share]
    tables = attach(
        args.checkpoint,
        tensors=PLE.selection,
        rows=rows,
        share=share,
        socket=args.socket,
        pad_rows=True,
        labels={"tp_rank": os.environ.get("RANK", "0")},
    )
    out: dict[str, Any] = {"mode": tables.mode, "served": sorted(tables.checkpoint_names)}
    for name, tensor in tables.items():
        start, stop = rows[name]
        layer = int(name.split(".layers.")[1].split(".")[0])
        part = name.rpartition(".")[2]
        held = max(0, min(stop, spec.rows_of(layer)) - start)
        data = tensor.view(torch.uint8).reshape(stop - start, -1)
        want = expected_ple_rows(spec, layer, part, torch.arange(start, start + held))
        where = mapping_of(tensor.data_ptr())
        out[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
            "same_bytes": bool(torch.equal(data[:held], want)),
            "padding_zero": bool((data[held:] == 0).all()),
            "map": where,
        }
    print(json.dumps(out), flush=True)
    tables.close()


if __name__ == "__main__":
    main()
