"""Engram-pattern gathers through a shared mapping against the same gathers on private tensors.

Each lookup step hashes T token positions into 24 heads' rows of one layer's
weight and scale tables and copies those rows into outputs allocated once.
Both sides use the same indices; the sides alternate within each repetition.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from engramd.demo.engram_hash import EngramHash, byte_rows, gather
from engramd_client import Tables, attach

from .common import Figure, any_shm, compare, daemon

LAYER = 1
HEADS = 24
#: Rows in each side's pool of index sets. Decoding never repeats a position,
#: so a step's rows must not still be in cache or TLB from an earlier step: a
#: small pool at T = 1 (16 sets of 24 rows) measured cache hits, not the table.
POOL_ROWS = 1 << 21
#: Seconds each side gathers per repetition.
WINDOW_S = 0.3


class Lookup:
    """Preallocated outputs and a pool of index sets for one layer."""

    def __init__(self, tables: Tables, tokens: int, seed: int = 0) -> None:
        self.weight = byte_rows(tables[f"layers.{LAYER}.engram.embed.weight"])
        self.scale = byte_rows(tables[f"layers.{LAYER}.engram.embed.scale"])
        h = EngramHash(rows=self.weight.shape[0], layer=LAYER, heads=HEADS)
        g = torch.Generator().manual_seed(seed)
        steps = max(16, POOL_ROWS // (tokens * HEADS))
        stream = torch.randint(0, 129_280, (steps * tokens + 2,), generator=g)
        self.indices = h.rows_for(stream).view(steps, tokens * HEADS).unbind()
        n = tokens * HEADS
        # zeros, not empty: an engine's outputs are long faulted in, and the
        # first step after attach must time the tables' pages, not these.
        self.w_out = torch.zeros(n, self.weight.shape[1], dtype=torch.uint8)
        self.s_out = torch.zeros(n, self.scale.shape[1], dtype=torch.uint8)
        self.next = 0

    def step(self) -> None:
        """One lookup step with the next index set of the pool."""
        rows = self.indices[self.next]
        self.next = (self.next + 1) % len(self.indices)
        gather(self.weight, rows, self.w_out)
        gather(self.scale, rows, self.s_out)

    def rate(self) -> float:
        """Rows per second over WINDOW_S."""
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < WINDOW_S:
            self.step()
            steps += 1
        return steps * self.indices[0].numel() / elapsed


def gather_throughput(ckpt: Path, reps: int, size_gib: float) -> list[Figure]:
    """Rows/s shared over private, for T = 1, 64, 4096 on 1 and 2 threads, 4 KiB and 2 MiB pages."""
    figures = []
    private = attach(ckpt, share=False)
    for huge in (False, True):
        with any_shm(huge, size_gib) as shm:
            if shm is None:
                print("  huge-page tmpfs: cannot mount here (needs root); not measured")
                continue
            pages = "2 MiB" if huge else "4 KiB"
            with daemon(shm, "--checkpoint", str(ckpt)) as d:
                # Populated: the steady state is measured here, the first step apart.
                shared = attach(ckpt, socket=str(d.socket), share=True, populate=True)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for tokens in (1, 64, 4096):
                        sides = {
                            "shared": Lookup(shared, tokens),
                            "private": Lookup(private, tokens),
                        }
                        for side in sides.values():
                            side.step()  # fault in what the first step touches
                        rates: dict[str, list[float]] = {"shared": [], "private": []}
                        for rep in range(reps):
                            order = ["shared", "private"] if rep % 2 else ["private", "shared"]
                            for name in order:
                                rates[name].append(sides[name].rate())
                        goal = 1.05 if huge else 0.95
                        figures.append(
                            compare(
                                f"gather T={tokens}, {threads} thread(s), shm on {pages} pages",
                                "Mrows/s",
                                [r / 1e6 for r in rates["shared"]],
                                [r / 1e6 for r in rates["private"]],
                                higher_is_better=True,
                                target=f">= {goal}x private (4 KiB pages)",
                                at_least=goal,
                            )
                        )
                        print(
                            f"  {figures[-1].name}: {figures[-1].ratio:.3f}x "
                            f"({figures[-1].ours:.1f} vs {figures[-1].baseline:.1f} Mrows/s)",
                            flush=True,
                        )
                torch.set_num_threads(2)
                figures += _first_gather(ckpt, str(d.socket), reps, pages)
                shared.close()
    private.close()
    return figures


def _first_gather(ckpt: Path, socket: str, reps: int, pages: str) -> list[Figure]:
    """The first T=4096 step after attach: lazy mapping, populated mapping, and warm."""
    attach_ms: dict[bool, list[float]] = {False: [], True: []}
    first_ms: dict[bool, list[float]] = {False: [], True: []}
    warm_ms: list[float] = []
    for _ in range(reps):
        for populate in (False, True):
            start = time.perf_counter()
            tables = attach(ckpt, socket=socket, share=True, populate=populate)
            attach_ms[populate].append((time.perf_counter() - start) * 1e3)
            lookup = Lookup(tables, 4096)
            for i in range(6):
                start = time.perf_counter()
                lookup.step()
                took = (time.perf_counter() - start) * 1e3
                if i == 0:
                    first_ms[populate].append(took)
                elif not populate:
                    warm_ms.append(took)
            tables.close()
    cost = statistics.median(attach_ms[True]) - statistics.median(attach_ms[False])
    print(
        f"  first step after attach ({pages}): lazy {statistics.median(first_ms[False]):.1f} ms,"
        f" populated {statistics.median(first_ms[True]):.1f} ms (populating costs {cost:.0f} ms"
        f" at attach), warm {statistics.median(warm_ms):.1f} ms",
        flush=True,
    )
    return [
        compare(
            f"first gather after attach, lazy, {pages} pages",
            "ms",
            first_ms[False],
            warm_ms,
            higher_is_better=False,
            target="reported (baseline: a warm step)",
        ),
        compare(
            f"first gather after attach, populated, {pages} pages",
            "ms",
            first_ms[True],
            warm_ms,
            higher_is_better=False,
            target="reported (baseline: a warm step)",
            note=f"populating costs {cost:.0f} ms at attach",
        ),
    ]
