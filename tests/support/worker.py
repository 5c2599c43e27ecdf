"""A worker process for the tests: attach, print one JSON line, then obey stdin.

Commands (one per line, each answered by one JSON line):
  digest        sha256 of every tensor's bytes (touches every page)
  mem           this process's memory (rss, uss, pss, shared) from psutil
  lease         the lease id (it changes when the lease is re-established) and whether
                the daemon holds a newer copy than the one mapped (stale)
  refresh       attach again (Tables.refresh), close the old tables, answer like lease
  write NAME    write into tensor NAME (a shared one must fault)
  lookups S     gather random rows of every synthetic table for S seconds, check each row
  churn S       close, then attach and close again and again for S seconds
  step          Tables.advance() once: the mode, whether a move waits, each tensor's address
  until_shared S  advance() every 2 ms until the tables are shared, at most S seconds: the
                mode and how long it took
  pending       whether a move waits for the next step (nothing moves), the set id
  follow ID S   advance() every 2 ms until the tables are on set ID, at most S seconds,
                sampling every table's rows at each step: the steps whose tables held
                rows of more than one synthetic seed (a mix of generations), the set id
  rows          every row of every tensor against the checkpoint's, read privately
  exit          close the tables and exit 0
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

import psutil
import torch

from engramd.testing.child import say
from engramd.testing.synth import seeds_held
from engramd_client import EngramdError, Tables, attach


def digests(tables: Tables) -> dict[str, str]:
    """sha256 of each tensor's bytes, read in place."""
    return {
        name: hashlib.sha256(tables[name].contiguous().view(torch.uint8).numpy().data).hexdigest()
        for name in tables
    }


def lookups(tables: Tables, seconds: float) -> dict[str, int]:
    """Gather and check rows of an `engramd synth` checkpoint's tables (seed 0)."""
    from engramd.testing.synth import expected_rows

    g = torch.Generator().manual_seed(os.getpid())
    count = bad = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in tables:
            layer, kind = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            table = tables[name].view(torch.uint8)
            rows = torch.randint(0, table.shape[0], (256,), generator=g)
            got = table.index_select(0, rows)
            bad += int((got != expected_rows(0, layer, kind, rows, table.shape[1])).any(1).sum())
            count += rows.numel()
    return {"lookups": count, "bad": bad}


def pointers(tables: Tables) -> dict[str, int]:
    """Each tensor's address."""
    return {name: tables[name].data_ptr() for name in tables}


def same_rows(tables: Tables, checkpoint: str) -> dict[str, bool]:
    """Whether each tensor holds, row for row, the checkpoint's bytes."""
    with attach(checkpoint, share=False) as reference:
        return {
            name: bool(
                torch.equal(tables[name].view(torch.uint8), reference[name].view(torch.uint8))
            )
            for name in tables
        }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--share", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument(
        "--untouched", action="store_true", help="touch no page at attach (hello's digests {})"
    )
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    share = {"auto": None, "on": True, "off": False}[args.share]
    start = time.perf_counter()
    try:
        tables = attach(
            args.checkpoint,
            share=share,
            socket=args.socket,
            labels=dict(kv.split("=", 1) for kv in args.label),
        )
    except EngramdError as e:
        say({"error": type(e).__name__, "message": str(e)})
        return 3
    say(
        {
            "mode": tables.mode,
            "reason": tables.reason,
            "set_id": tables.set_id,
            "lease_id": tables.lease_id,
            "attach_s": time.perf_counter() - start,
            "live": tables.live,
            "pointers": pointers(tables),
            "digests": {} if args.untouched else digests(tables),
        }
    )
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "digest":
            say({"digests": digests(tables)})
        elif command == "mem":
            m = psutil.Process().memory_full_info()
            say({"rss": m.rss, "uss": m.uss, "pss": m.pss, "shared": m.shared})
        elif command == "lease":
            say({"lease_id": tables.lease_id, "stale": tables.stale})
        elif command == "refresh":
            fresh = tables.refresh()
            tables.close()
            tables = fresh
            say({"lease_id": tables.lease_id, "stale": tables.stale})
        elif command == "write":
            tables[arg].view(torch.uint8).view(-1)[:4096].fill_(0x5A)
            say({"wrote": arg})
        elif command == "lookups":
            say(lookups(tables, float(arg)))
        elif command == "churn":
            tables.close()
            cycles, deadline = 0, time.monotonic() + float(arg)
            while time.monotonic() < deadline:
                tables = attach(args.checkpoint, share=share, socket=args.socket)
                tables.close()
                cycles += 1
            say({"cycles": cycles})
        elif command == "step":
            moved = tables.advance()
            say(
                {
                    "moved": moved,
                    "mode": tables.mode,
                    "pending": tables.pending,
                    "pointers": pointers(tables),
                }
            )
        elif command == "pending":
            say({"pending": tables.pending, "mode": tables.mode, "set_id": tables.set_id})
        elif command == "follow":
            target, _, bound = arg.partition(" ")
            began, steps, mixed = time.monotonic(), 0, 0
            while tables.set_id != target and time.monotonic() - began < float(bound):
                tables.advance()
                steps += 1
                mixed += len(seeds_held(tables)) != 1
                time.sleep(0.002)
            say(
                {
                    "set_id": tables.set_id,
                    "steps": steps,
                    "mixed": mixed,
                    "seeds": sorted(map(str, seeds_held(tables))),
                    "pointers": pointers(tables),
                }
            )
        elif command == "until_shared":
            began = time.monotonic()
            while tables.mode != "shared" and time.monotonic() - began < float(arg):
                tables.advance()
                time.sleep(0.002)
            say({"mode": tables.mode, "seconds": time.monotonic() - began})
        elif command == "rows":
            say({"same": same_rows(tables, args.checkpoint)})
        elif command == "exit":
            tables.close()
            say({"closed": True})
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
