"""The memory a daemon may use, from /proc and cgroup v1 and v2 (engramd.host.memlimit)."""

from __future__ import annotations

from pathlib import Path

from engramd.host.memlimit import MemoryLimit, memory_limit


def test_memory_limit_reads_cgroup_v1_and_v2(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 4194304 kB\nMemAvailable: 3145728 kB\n")
    (proc / "self/cgroup").write_text("0::/\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("memory\n")
    assert memory_limit(str(proc), str(v2)) == MemoryLimit(
        "host memory (MemTotal)", 4 << 30, 3 << 30
    )
    (proc / "self/cgroup").write_text("0::/system.slice/engramd.service\n")
    service = v2 / "system.slice/engramd.service"
    service.mkdir(parents=True)
    (service / "memory.max").write_text(f"{1 << 30}\n")
    (service / "memory.current").write_text(f"{256 << 20}\n")
    (v2 / "system.slice/memory.max").write_text("max\n")
    (v2 / "system.slice/memory.current").write_text("0\n")
    assert memory_limit(str(proc), str(v2)) == MemoryLimit(
        "cgroup /system.slice/engramd.service memory.max", 1 << 30, 768 << 20
    )
    # cgroup v1: the memory controller's own hierarchy; "no limit" is a huge number.
    (proc / "self/cgroup").write_text("4:memory:/docker/abc\n0::/\n")
    v1 = tmp_path / "v1"
    (v1 / "memory/docker/abc").mkdir(parents=True)
    (v1 / "memory/docker/abc/memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory/docker/abc/memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory/memory.usage_in_bytes").write_text("0\n")
    assert memory_limit(str(proc), str(v1)) == MemoryLimit(
        "cgroup /docker/abc memory.limit_in_bytes", 2 << 30, 1 << 30
    )
