"""Several worker processes share one copy; a shared mapping cannot be written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import Worker, start_workers
from engramd_client import plan_tables
from helpers import reference_digests, shmem_bytes


def test_four_workers_share_one_copy(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    before = shmem_bytes()
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    expected = reference_digests(checkpoint)
    start_workers(workers, 4, checkpoint, d.socket, "on", lambda rank: {"dp_rank": str(rank)})
    for w in workers:
        assert w.hello["mode"] == "shared", w.hello
        # The digest read every byte, so every page is mapped in every worker.
        assert w.hello["digests"] == expected
    grown = shmem_bytes() - before
    assert grown <= 1.05 * s.bytes, f"shared memory grew {grown} bytes for a {s.bytes}-byte set"
    assert grown >= 0.95 * s.bytes, "the set is not in shared memory at all"
    [s] = d.status().sets
    assert sorted(lease.labels["dp_rank"] for lease in s.leases) == ["0", "1", "2", "3"]
    assert {lease.pid for lease in s.leases} == {w.proc.pid for w in workers}
    for w in workers:
        assert w.exit() == 0
    assert not d.status().sets[0].leases


def test_write_through_shared_tensor_faults(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    name = "layers.1.engram.embed.weight"
    victim = Worker(checkpoint, d.socket, share="on")
    workers.append(victim)
    victim.send(f"write {name}")
    assert victim.proc.wait(timeout=30) == -signal.SIGSEGV
    reader = Worker(checkpoint, d.socket, share="on")
    workers.append(reader)
    assert reader.hello["digests"][name] == reference_digests(checkpoint)[name]


def test_private_tensor_is_writable_and_separate(
    checkpoint: Path, workers: list[Worker], sock_dir: Path
) -> None:
    before = shmem_bytes()
    w = Worker(checkpoint, sock_dir / "none.sock", share="off")
    workers.append(w)
    # Private tables are the worker's own memory, not shared memory.
    assert shmem_bytes() - before < plan_tables(checkpoint).nbytes // 2
    name = "layers.1.engram.embed.weight"
    assert w.ask(f"write {name}") == {"wrote": name}
    assert w.ask("digest")["digests"][name] != reference_digests(checkpoint)[name]


_ANON_HUGE = textwrap.dedent(
    """
    import json, sys
    from engramd_client import attach

    def anon_huge():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) << 10
        return 0

    before = anon_huge()
    tables = attach(sys.argv[1], share=False)
    print(json.dumps({"grew": anon_huge() - before, "nbytes": tables.nbytes}))
    """
)


@pytest.mark.parametrize("thp", ["on", "off"])
def test_private_tables_take_transparent_huge_pages(checkpoint: Path, thp: str) -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip(f"this kernel gives no transparent huge pages (enabled: {mode.strip()})")
    env = {**os.environ, "ENGRAMD_PRIVATE_THP": thp}
    out = subprocess.run(
        [sys.executable, "-c", _ANON_HUGE, str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    if thp == "on":
        # Every whole 2 MiB of a table's private mapping (THP "madvise" or "always").
        assert report["grew"] >= report["nbytes"] // 2, report
    else:
        assert report["grew"] < 2 << 20, report
