"""NUMA placement: the policy as the kernel records it, two-node data, a daemon bound to a node.

This machine has one node: the policy code is checked against the kernel
here (get_mempolicy) and against a recorded two-node sysfs and numa_maps;
it has not run on two nodes.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon
from engramd.numa import (
    MPOL_BIND,
    MPOL_DEFAULT,
    MPOL_INTERLEAVE,
    NumaError,
    Placement,
    applied,
    bytes_per_node,
    node_mask,
    nodes,
)
from engramd_client import plan_tables

_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}

#: numa_maps lines in the kernel's format for a two-node host's mappings of sets (4 KiB
#: and 1 GiB pages, a memfd and its manifest): written by hand, this machine has one node.
TWO_NODE_NUMA_MAPS = (Path(__file__).parent / "data" / "two-node-numa_maps.txt").read_text()


def this_threads_policy() -> tuple[int, list[int]]:
    """(mode, nodes) of the calling thread's memory policy, from get_mempolicy(2)."""
    number = _GET_MEMPOLICY.get(platform.machine())
    if number is None:
        pytest.skip(f"no get_mempolicy number known for {platform.machine()}")
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64 + 1), None, 0) == 0
    return mode.value, [n for n in range(16 * 64) if mask[n // 64] >> (n % 64) & 1]


def test_policies_reach_the_kernel_and_are_undone() -> None:
    assert this_threads_policy()[0] == MPOL_DEFAULT
    with applied(Placement("interleave")):
        assert this_threads_policy() == (MPOL_INTERLEAVE, nodes())
    assert this_threads_policy()[0] == MPOL_DEFAULT
    with applied(Placement("node:0")):
        assert this_threads_policy() == (MPOL_BIND, [0])
    assert this_threads_policy()[0] == MPOL_DEFAULT


def test_two_nodes_from_a_recorded_sysfs(tmp_path: Path) -> None:
    (tmp_path / "has_memory").write_text("0-1\n")
    (tmp_path / "online").write_text("0-1\n")
    assert nodes(tmp_path) == [0, 1]
    assert Placement.parse("interleave", tmp_path).mode_and_nodes(tmp_path) == (
        MPOL_INTERLEAVE,
        [0, 1],
    )
    assert Placement.parse("node:1", tmp_path).mode_and_nodes(tmp_path) == (MPOL_BIND, [1])
    with pytest.raises(NumaError, match=r"node 2 has no memory; nodes: \[0, 1\]"):
        Placement.parse("node:2", tmp_path)
    with pytest.raises(NumaError, match="use interleave or node:N"):
        Placement.parse("nearest", tmp_path)
    mask, maxnode = node_mask([0, 1, 65])
    assert (mask[0], mask[1], maxnode) == (0b11, 0b10, 129)


def test_bytes_per_node_from_a_recorded_numa_maps() -> None:
    tmpfs = bytes_per_node(TWO_NODE_NUMA_MAPS, "/dev/shm/engramd/0123456789abcdef0123/")
    assert tmpfs == {0: 131072 * 4096, 1: (131072 + 1024) * 4096}
    huge = bytes_per_node(TWO_NODE_NUMA_MAPS, "/engramd/fedcba98765432100123/")
    assert huge == {1: 2 << 30}
    # The set's memfd, not its manifest's (numa_maps writes the blank as \040).
    memfd = bytes_per_node(TWO_NODE_NUMA_MAPS, "/memfd:engramd-0123456789abcdef0123 ")
    assert memfd == {0: 5 * 4096, 1: 3 * 4096}


def test_a_daemon_bound_to_a_node_reports_where_its_set_is(
    checkpoint: Path, daemons: Any, sock_dir: Path
) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--numa", "node:0", "--backing", "memfd")
    d_status = d.status()
    [s] = d_status.sets
    assert s.locked, "numa_maps is read from the daemon's pinned mappings"
    pages = sum(-(-t.nbytes // s.page_size) * s.page_size for t in plan_tables(checkpoint).tensors)
    assert dict(s.bytes_per_node) == {0: pages}
    bad = Daemon(sock_dir / "b.sock", d.shm_dir, ["--numa", "node:7"], sock_dir / "b.log")
    with pytest.raises(RuntimeError, match="exited with"):
        bad.start()
    assert "node 7 has no memory" in bad.log
