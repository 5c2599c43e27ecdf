"""NUMA placement of a set's pages: the policy, the nodes, where pages ended up.

A set's pages are allocated when the loader reserves them (reserve.py), so
the policy is the loading thread's memory policy, set with set_mempolicy(2)
around the reservation and reset after (the copy then writes into pages
that already exist); the reservation's threads read it (get_mempolicy(2))
and set it on each. Python has no
binding for either and libnuma may be absent, so the syscalls are made
through ctypes. Where pages are is read back from /proc/<pid>/numa_maps
(N<node>=<pages> of each mapping).

The placement itself (`--numa`, parsed once) is engramd.values.Placement.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
from collections.abc import Iterator

from engramd.values import NumaError, Placement

MPOL_DEFAULT, MPOL_BIND, MPOL_INTERLEAVE = 0, 2, 3
# set_mempolicy(2) and get_mempolicy(2) have no libc wrapper everywhere; their numbers.
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
# Nodes get_mempolicy(2) may report: far above any machine's (Linux's MAX_NUMNODES is 1024).
_MAX_NODES = 4096
_libc = ctypes.CDLL(None, use_errno=True)


def mode_and_nodes(placement: Placement) -> tuple[int, list[int]]:
    """The set_mempolicy mode and node list of a placement (per-node: the kernel's)."""
    if placement.interleaved:
        return MPOL_INTERLEAVE, list(placement.nodes)
    if placement.node is not None:
        return MPOL_BIND, [placement.node]
    return MPOL_DEFAULT, []


def node_mask(node_ids: list[int]) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """The nodemask set_mempolicy(2) takes, and its maxnode argument."""
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = max(node_ids, default=0) // bits + 1
    mask = (ctypes.c_ulong * words)()
    for n in node_ids:
        mask[n // bits] |= 1 << (n % bits)
    return mask, words * bits + 1


def applied(placement: Placement) -> contextlib.AbstractContextManager[None]:
    """This thread allocates pages by `placement` inside the block (the kernel's way after)."""
    return following(mode_and_nodes(placement))


def thread_policy() -> tuple[int, list[int]]:
    """This thread's memory policy (mode, nodes), to apply on other threads (`following`):
    a backing that reserves on several threads allocates as its caller's thread would."""
    number = _GET_MEMPOLICY.get(platform.machine())
    if number is None:
        return MPOL_DEFAULT, []
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * (_MAX_NODES // bits))()
    flags = ctypes.c_ulong(0)
    if _libc.syscall(number, ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, flags):
        # Refused (Docker's default seccomp profile allows the mempolicy calls only with
        # CAP_SYS_NICE): then set_mempolicy is refused too, and no policy was applied.
        return MPOL_DEFAULT, []
    if mode.value == MPOL_DEFAULT:
        return MPOL_DEFAULT, []
    return mode.value, [n for n in range(_MAX_NODES) if mask[n // bits] >> (n % bits) & 1]


@contextlib.contextmanager
def following(policy: tuple[int, list[int]]) -> Iterator[None]:
    """This thread allocates pages by `policy` (mode, nodes) inside the block."""
    mode, node_ids = policy
    if mode == MPOL_DEFAULT:
        yield
        return
    _set_mempolicy(mode, node_ids)
    try:
        yield
    finally:
        _set_mempolicy(MPOL_DEFAULT, [])


def _set_mempolicy(mode: int, node_ids: list[int]) -> None:
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise NumaError(f"--numa is not supported on {platform.machine()} yet")
    mask, maxnode = node_mask(node_ids) if node_ids else (None, 0)
    if _libc.syscall(number, mode, mask, ctypes.c_ulong(maxnode)) != 0:
        errno = ctypes.get_errno()
        raise NumaError(f"set_mempolicy({mode}, {node_ids}): {os.strerror(errno)}")


def bytes_per_node(numa_maps: str, match: str) -> dict[int, int]:
    """Bytes on each node of the mappings whose line contains `match` (numa_maps text)."""
    found: dict[int, int] = {}
    for line in numa_maps.splitlines():
        # numa_maps escapes blanks in file names, as in "/memfd:x\\040(deleted)".
        if match not in line.replace("\\040", " "):
            continue
        page = 4096
        counts = {}
        for field in line.split():
            key, _, value = field.partition("=")
            if key == "kernelpagesize_kB":
                page = int(value) << 10
            elif re.fullmatch(r"N\d+", key):
                counts[int(key[1:])] = int(value)
        for node, pages in counts.items():
            found[node] = found.get(node, 0) + pages * page
    return found
