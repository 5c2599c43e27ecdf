"""A benchmark replica: attach (shared, private, or not at all), then obey stdin.

(start)  -> {"ready": true} once imported; with --wait-go it then waits for "go"
         -> {"mode", "attach_s", "attach_cpu_s"} after attaching (CPU: all its threads)
touch    -> {"touched": bytes} after reading one byte of every page of every table
exit     -> closes the tables and exits
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from engramd.testing.child import say
from engramd_client import Tables, attach

PAGE = 4096


def touch(tables: Tables) -> int:
    """Fault in every page of every table (one byte read per page)."""
    total = 0
    for name in tables:
        flat = tables[name].view(torch.uint8).view(-1)
        flat[::PAGE].sum()
        total += flat.numel()
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--mode", choices=["shared", "private", "none"], required=True)
    parser.add_argument("--wait-go", action="store_true")
    args = parser.parse_args()
    # Start torch's thread pool now: its stacks and page tables must not be
    # counted as the cost of touching the tables.
    torch.ones(1 << 20).sum()
    say({"ready": True})
    if args.wait_go and sys.stdin.readline().strip() != "go":
        return 1
    tables: Tables | None = None
    start, cpu = time.perf_counter(), time.process_time()
    if args.mode != "none":
        tables = attach(args.checkpoint, socket=args.socket, share=args.mode == "shared")
    say(
        {
            "mode": tables.mode if tables else "none",
            "attach_s": time.perf_counter() - start,
            "attach_cpu_s": time.process_time() - cpu,
        }
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "touch":
            say({"touched": touch(tables) if tables else 0})
        elif command == "exit":
            break
    if tables is not None:
        tables.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
