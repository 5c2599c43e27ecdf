"""What proving a held set costs, and what a store's headers cost a planning node (bench
section "proof").

- proof: a held set not loaded from the operator's own unchanged files is published (or
  handed to a worker's checkpoint) only once the files' BLAKE3 pieces (engramd.strong)
  equal the set's own: CPU seconds and wall seconds a GiB for the files' digest (in the page
  cache) and for the set's pages' (tmpfs), against the XXH3 pieces the proof used to take
  (which a forged copy passes). One thread, as one proof runs.
- planning: a header of zero-size tensors parsed as a store's is
  (engramd_shared.headers.header_of), its traced peak against what the planning charged it
  (fleet/objectplan.py: COPIES x bytes + VALUE_BYTES x values), and its CPU seconds per
  100,000 entries.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

from engramd.checksum import CHECKSUM
from engramd.fleet.s3api import COPIES, parse_cost
from engramd.strong import STRONG, digest_fd_as
from engramd_shared.fileid import SourceFile
from engramd_shared.headers import header_of

from .common import Figure, GiB, compare


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _digest_costs(path: Path, like: str) -> tuple[float, float]:
    """(CPU s, wall s) a GiB of digesting `path` (in memory) as `like` names."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        cpu, wall = _cpu(), time.monotonic()
        digest_fd_as(fd, 0, size, like)
        cpu, wall = _cpu() - cpu, time.monotonic() - wall
    finally:
        os.close(fd)
    return cpu * GiB / size, wall * GiB / size


def proof_costs(size_gib: float, reps: int) -> list[Figure]:
    """The strong proof's cost a GiB against the XXH3 one's, on a file in /dev/shm."""
    folder = Path(tempfile.mkdtemp(prefix="engramd-bench-proof-", dir="/dev/shm"))
    try:
        data = folder / "tensor"
        with data.open("wb") as f:
            chunk = os.urandom(64 << 20)
            for _ in range(max(1, int(size_gib * GiB) // len(chunk))):
                f.write(chunk)
        strong_cpu, weak_cpu, strong_wall, weak_wall = [], [], [], []
        for _ in range(reps):
            cpu, wall = _digest_costs(data, f"{STRONG}:")
            strong_cpu.append(cpu)
            strong_wall.append(wall)
            cpu, wall = _digest_costs(data, f"{CHECKSUM}:")
            weak_cpu.append(cpu)
            weak_wall.append(wall)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    note = (
        "paid once per side at publication (the files' digest, then the held set's pages'), "
        "only for a set not loaded from the operator's unchanged files; none at load or "
        "adoption"
    )
    return [
        compare(
            "proof: BLAKE3 pieces vs XXH3 pieces, CPU a GiB",
            "CPU-s",
            strong_cpu,
            weak_cpu,
            higher_is_better=False,
            paired=True,
            note=note,
        ),
        compare(
            "proof: BLAKE3 pieces vs XXH3 pieces, wall a GiB",
            "s",
            strong_wall,
            weak_wall,
            higher_is_better=False,
            paired=True,
        ),
    ]


def planning_costs(entries: int) -> list[Figure]:
    """A header of `entries` zero-size tensors: traced peak of its parse against its charge,
    and CPU seconds per 100,000 entries."""
    doc = {
        f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w": {
            "dtype": "F32",
            "shape": [0],
            "data_offsets": [0, 0],
        }
        for i in range(entries)
    }
    header = json.dumps(doc, separators=(",", ":")).encode()
    del doc
    charged = COPIES * len(header) + parse_cost(header)
    source = SourceFile("a", 0, 0, 8 + len(header), 0, 0)
    cpu = _cpu()
    header_of(Path("a.safetensors"), 8 + len(header), header, "x", source)
    cpu = _cpu() - cpu
    tracemalloc.start()
    try:
        parsed = header_of(Path("a.safetensors"), 8 + len(header), header, "x", source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(parsed.tensors) == entries
    return [
        compare(
            f"planning: a header of {entries:,} entries, traced peak vs charged",
            "MiB",
            [peak / (1 << 20)],
            [charged / (1 << 20)],
            higher_is_better=False,
            note="the charge must stay above the peak (ratio above 1)",
        ),
        compare(
            "planning: CPU per 100,000 entries parsed",
            "CPU-s",
            [cpu * 100_000 / entries],
            None,
            higher_is_better=False,
        ),
    ]
