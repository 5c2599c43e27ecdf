"""A disk set's page cache warmed by the daemon once it is served (`--warm-page-cache`): read in
after the caches are dropped, shown by status and metrics, stopped within a memory cgroup smaller
than the set, left cold when turned off."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engramd.cli.status_view import render
from engramd.testing.pagecache import cached, evict
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.pb import engramd_pb2 as pb
from fleet_lab import free_port
from helpers import memory_cgroup_folder, wait_until


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128 MiB of tables: more than the cgroup test's daemon has room for."""
    return synthesize(tmp_path_factory.mktemp("warm-ckpt") / "engram", SynthSpec(rows=254_250))


def _adopted_cold(daemons: Any, disk: Path, tables: Path) -> tuple[int, int]:
    """Load the set on the disk backing, stop the daemon, drop the set's pages from the
    page cache; returns the set's size and the length of the daemons' log so far."""
    d = daemons("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(tables))
    [s] = d.status().sets
    d.stop()
    evict(disk)
    assert cached(disk) < s.bytes / 20
    return int(s.bytes), len(d.log)


def _warm_state(d: Any) -> pb.SetInfo:
    [s] = d.status().sets
    return s


def _settled(d: Any) -> pb.SetInfo:
    """The set once its warm-up ended (warmed, stopped or off)."""
    wait_until(
        lambda: _warm_state(d).page_cache_warming not in ("", "waiting", "warming"),
        60,
        "the warm-up to end",
    )
    return _warm_state(d)


def test_an_adopted_cold_set_is_warmed_into_the_page_cache_and_status_shows_it(
    tables: Path, disk: Path, daemons: Any
) -> None:
    size, logged = _adopted_cold(daemons, disk, tables)
    port = free_port()
    d = daemons(
        *("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(tables)),
        *("--metrics-port", str(port)),
    )
    s = _settled(d)
    assert s.adopted and s.page_cache_warming == "warmed", s.page_cache_warming
    # Every byte of the set's tensors is back, read by the daemon, no worker attached.
    assert s.resident_bytes >= size * 0.99, (s.resident_bytes, size)
    assert cached(disk) >= size * 0.99
    assert d.log[logged:].count("warming set") == 1
    [ended] = [line for line in d.log[logged:].splitlines() if "warmed:" in line]
    assert "MiB read in" in ended and "GB/s" in ended, ended
    row = next(line for line in render(d.status()).splitlines() if s.set_id in line)
    assert "100% (warmed)" in row, row
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "engramd", "status", "--json", "--socket", str(d.socket)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    [js] = doc["sets"]
    assert js["page_cache_warming"] == "warmed" and js["resident_bytes"] >= size * 0.99
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    [metric] = [line for line in text.splitlines() if line.startswith("engramd_set_cached_bytes{")]
    assert f'set_id="{s.set_id}"' in metric and float(metric.split()[-1]) >= size * 0.99

    # Evicted again, then a restart: each daemon warms the set once more, not each engine.
    d.stop()
    evict(disk)
    again = daemons("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(tables))
    assert _settled(again).resident_bytes >= size * 0.99


def test_the_warm_up_turned_off_leaves_the_set_cold(tables: Path, disk: Path, daemons: Any) -> None:
    size, logged = _adopted_cold(daemons, disk, tables)
    d = daemons(
        *("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(tables)),
        "--no-warm-page-cache",
    )
    s = _settled(d)
    assert s.page_cache_warming == "off"
    assert s.resident_bytes < size / 20 and cached(disk) < size / 20
    assert "warming set" not in d.log[logged:]
    row = next(line for line in render(d.status()).splitlines() if s.set_id in line)
    assert "(off)" in row, row


def _cgroup_usage(group: Path, limit_file: str) -> int:
    usage = "memory.current" if limit_file == "memory.max" else "memory.usage_in_bytes"
    return int((group / usage).read_text())


def test_a_daemon_in_a_memory_cgroup_smaller_than_the_set_stops_warming_and_lives(
    tables: Path, disk: Path, daemons: Any
) -> None:
    size, logged = _adopted_cold(daemons, disk, tables)
    args = ("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(tables))
    # What the daemon itself takes in a cgroup, the set left cold.
    with memory_cgroup_folder(1 << 40) as (group, limit_file):
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        d = daemons(*args, "--no-warm-page-cache", python=["sh", "-c", join, "sh", sys.executable])
        _settled(d)
        own = _cgroup_usage(group, limit_file)
        d.stop()
    evict(disk)
    # Room for the daemon and a quarter of the set: the cgroup is smaller than the set.
    limit = own + size // 4
    assert limit < size
    with memory_cgroup_folder(limit) as (group, limit_file):
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        d = daemons(*args, python=["sh", "-c", join, "sh", sys.executable])
        s = _settled(d)
        assert s.page_cache_warming.startswith("stopped: memory"), s.page_cache_warming
        assert d.proc.poll() is None  # not killed: the warm-up read only what fit
        assert 0 < s.resident_bytes < size / 2, (s.resident_bytes, size)
        assert "warm-up stopped (memory" in d.log[logged:]
        assert "page cache warm-up stopped: memory" in render(d.status())
        d.stop()
