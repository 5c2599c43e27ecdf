"""NUMA placement: the policy as the kernel records it, two-node data, a daemon bound to a node.

This machine has one node: the policy code is checked against the kernel
here (get_mempolicy) and against a recorded two-node sysfs and numa_maps;
it has not run on two nodes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import Daemon, Worker, wait_until
from engramd.host import numa as numa_module
from engramd.host.numa import (
    MPOL_BIND,
    MPOL_DEFAULT,
    MPOL_INTERLEAVE,
    applied,
    bytes_per_node,
    following,
    mode_and_nodes,
    node_mask,
    thread_policy,
)
from engramd.testing.synth import SynthSpec, synthesize
from engramd.values import NumaError, Placement
from engramd_client import plan_tables
from engramd_shared.layout import extents, sets_root
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from engramd_shared.topology import local_node, nodes
from helpers import (
    InProcessDaemon,
    attach_error,
    in_process_config,
    reference_digests,
    set_folders,
    shmem_bytes,
)

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
    with applied(Placement.parse("interleave")):
        assert this_threads_policy() == (MPOL_INTERLEAVE, nodes())
    assert this_threads_policy()[0] == MPOL_DEFAULT
    with applied(Placement.parse("node:0")):
        assert this_threads_policy() == (MPOL_BIND, [0])
    assert this_threads_policy()[0] == MPOL_DEFAULT


def _follow(policy: tuple[int, list[int]], seen: list[tuple[int, list[int]]]) -> None:
    with following(policy):
        seen.append(this_threads_policy())
    seen.append(this_threads_policy())


def test_a_threads_policy_is_read_back_and_followed_on_another_thread() -> None:
    """What a backing reserving on several threads relies on: each thread allocates as the
    caller's thread would, and is back to the kernel's way after."""
    assert thread_policy() == (MPOL_DEFAULT, [])
    for placement in ("interleave", "node:0"):
        with applied(Placement.parse(placement)):
            policy = thread_policy()
            assert policy == this_threads_policy() != (MPOL_DEFAULT, [])
        seen: list[tuple[int, list[int]]] = []
        t = threading.Thread(target=_follow, args=(policy, seen))
        t.start()
        t.join()
        assert seen == [policy, (MPOL_DEFAULT, [])]


def test_a_refused_get_mempolicy_reads_as_the_kernels_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the call is refused (a seccomp profile without CAP_SYS_NICE), so is setting a
    policy: a load's reservation threads then follow the kernel's way, not fail."""
    monkeypatch.setitem(numa_module._GET_MEMPOLICY, platform.machine(), 100_000)  # ENOSYS
    assert thread_policy() == (MPOL_DEFAULT, [])


def test_two_nodes_from_a_recorded_sysfs(tmp_path: Path) -> None:
    (tmp_path / "has_memory").write_text("0-1\n")
    (tmp_path / "online").write_text("0-1\n")
    assert nodes(tmp_path) == [0, 1]
    assert mode_and_nodes(Placement.parse("interleave", tmp_path)) == (MPOL_INTERLEAVE, [0, 1])
    assert mode_and_nodes(Placement.parse("node:1", tmp_path)) == (MPOL_BIND, [1])
    with pytest.raises(NumaError, match=r"node 2 has no memory; nodes: \[0, 1\]"):
        Placement.parse("node:2", tmp_path)
    with pytest.raises(NumaError, match="use interleave, node:N or per-node"):
        Placement.parse("nearest", tmp_path)
    per_node = Placement.parse("per-node", tmp_path)
    assert per_node.copy_nodes == [0, 1]
    assert mode_and_nodes(per_node) == (MPOL_DEFAULT, [])
    assert mode_and_nodes(per_node.for_copy(1)) == (MPOL_BIND, [1])
    # A worker maps its node's copy; one whose node the daemon does not know, node 0's.
    assert [per_node.copy_node_for(n) for n in (0, 1, 7, None)] == [0, 1, 0, 0]
    one_copy = Placement.parse("interleave", tmp_path)
    assert one_copy.copy_nodes == [None] and one_copy.copy_node_for(1) is None
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
    # numa_maps is read from the daemon's pinned mappings, which come after the set is served.
    wait_until(lambda: d.status().sets[0].locked, 30, "the set to be locked")
    [s] = d.status().sets
    places = extents(plan_tables(checkpoint).tensors)
    pages = sum(-(-n // s.page_size) * s.page_size for n in places)
    assert dict(s.bytes_per_node) == {0: pages}
    bad = Daemon(sock_dir / "b.sock", d.shm_dir, ["--numa", "node:7"], sock_dir / "b.log")
    with pytest.raises(RuntimeError, match="exited with"):
        bad.start()
    assert "node 7 has no memory" in bad.log


def _two_node_sysfs(root: Path) -> Path:
    """A recorded two-node host's /sys/devices/system/node: CPUs 0-3 on node 0, 4-7 on node 1."""
    root.mkdir()
    for name in ("has_memory", "online"):
        (root / name).write_text("0-1\n")
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (root / f"node{node}").mkdir()
        (root / f"node{node}" / "cpulist").write_text(f"{cpus}\n")
    return root


def test_a_worker_s_node_is_where_most_of_its_cpus_are(tmp_path: Path) -> None:
    root = _two_node_sysfs(tmp_path / "sys")
    assert local_node(root, cpus={5, 6}) == 1
    assert local_node(root, cpus={0, 5, 6}) == 1
    assert local_node(root, cpus={3, 4}) == 0, "a tie goes to the lowest node"
    assert local_node(tmp_path / "no-numa") is None
    assert local_node() == nodes()[0], "this machine's one node"


def _attach(
    sock: Path, set_id: str, numa_node: int | None, checkpoint: Path | None = None
) -> tuple[Any, pb.Attachment]:
    """A raw Attach stream (reattach: the daemon may not load for it) and its Attachment.

    A set a worker's attach loaded is attached with its `checkpoint` (a bare id
    attaches only sets the operator loaded), and only for descriptors.
    """
    request = pb.AttachRequest(
        set_id=set_id,
        checkpoint=str(checkpoint or ""),
        pid=os.getpid(),
        accept=[pb.HANDLE_KIND_FD if checkpoint else pb.HANDLE_KIND_SHM],
        reattach=True,
        numa_node=numa_node,
    )
    channel = grpc.insecure_channel(f"unix:{sock}")
    call = pb_grpc.TableServiceStub(channel).Attach(request, timeout=60)
    attached = next(e for e in call if e.WhichOneof("event") == "attached").attached
    return (channel, call), attached


def _read_back(
    attachment: pb.Attachment, checkpoint: Path, d: InProcessDaemon | None = None
) -> Path:
    """The one folder the attachment's tensors are in, once every byte equals the checkpoint's.

    Descriptor handles name no folder: the daemon `d` says which copy the lease holds.
    """
    source = {t.name: t for t in plan_tables(checkpoint).tensors}
    folder = None
    if d is not None:
        found = d.server.store.leases.find(attachment.lease_id)
        assert found is not None
        held, _ = found
        assert held.manifest is not None
        folder = sets_root(d.server.config.shm_dir) / held.manifest.copy
    for h in attachment.tensors:
        t = source[h.name]
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            expected = f.read(t.nbytes)
        path, offset, length = (
            (folder / h.fd.file, h.fd.offset, h.fd.length)
            if folder is not None
            else (Path(h.shm.path), h.shm.offset, h.shm.length)
        )
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(length) == expected, h.name
    if folder is not None:
        return folder
    [shared] = {h.shm.set_dir for h in attachment.tensors}
    return Path(shared)


def test_per_node_keeps_a_copy_on_each_node_of_a_recorded_two_node_host(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's real code on two nodes, with the kernel's side recorded, not made.

    This machine has one node, so the kernel refuses a binding to node 1: the
    sysfs is a recorded two-node one, and set_mempolicy(2) is recorded per
    loading thread instead of made. Everything else is the real daemon: its
    store, loader, tmpfs files, gRPC service and adoption.
    """
    root = _two_node_sysfs(tmp_path / "sys")
    policies: list[tuple[int, int, list[int]]] = []

    def record(mode: int, node_ids: list[int]) -> None:
        policies.append((threading.get_ident(), mode, node_ids))

    monkeypatch.setattr(numa_module, "_set_mempolicy", record)
    set_id = plan_tables(checkpoint).set_id
    config = in_process_config(
        sock_dir, shm_dir, checkpoints=[str(checkpoint)], numa=Placement.parse("per-node", root)
    )
    with InProcessDaemon(config) as d:
        wait_until(lambda: d.server.store.ready, 60, "both copies of the configured set")
        assert {ts.key for ts in d.server.store.sets.all()} == {
            (set_id, "tmpfs", 0),
            (set_id, "tmpfs", 1),
        }
        # Each copy's pages were reserved under a binding to its node, undone after.
        bound = []
        for thread in {t for t, _, _ in policies}:
            mine = [(mode, ids) for t, mode, ids in policies if t == thread]
            assert mine[1::2] == [(MPOL_DEFAULT, [])] * (len(mine) // 2) and len(mine) % 2 == 0
            bound += mine[::2]
        assert sorted(bound) == [(MPOL_BIND, [0]), (MPOL_BIND, [1])]
        sock = sock_dir / "d.sock"
        on_one, attached_one = _attach(sock, set_id, numa_node=1)
        on_zero, attached_zero = _attach(sock, set_id, numa_node=0)
        unknown, attached_unknown = _attach(sock, set_id, numa_node=None)
        assert _read_back(attached_one, checkpoint).name == f"{set_id}-node1"
        assert _read_back(attached_zero, checkpoint).name == f"{set_id}-node0"
        assert _read_back(attached_unknown, checkpoint).name == f"{set_id}-node0"
        status = d.server.listeners.service.status()
        assert sorted((s.numa_node, s.lease_count) for s in status.sets) == [(0, 2), (1, 1)]
        for channel, call in (on_one, on_zero, unknown):
            call.cancel()
            channel.close()
    # The next daemon adopts both copies; one run without per-node removes them
    # (they were bound to nodes it does not keep copies for) and loads one copy.
    with InProcessDaemon(config) as d:
        wait_until(lambda: d.server.store.ready, 60, "the adopted copies")
        assert sorted((ts.node, ts.adopted) for ts in d.server.store.sets.all()) == [
            (0, True),
            (1, True),
        ]
    with InProcessDaemon(dataclasses.replace(config, numa=Placement())) as d:
        wait_until(lambda: d.server.store.ready, 60, "the set's one copy")
        [ts] = d.server.store.sets.all()
        assert (ts.node, ts.adopted) == (None, False)
        assert sorted(p.name for p in set_folders(shm_dir)) == [set_id]


def test_per_node_loads_a_worker_s_copy_on_demand(
    checkpoint: Path, sock_dir: Path, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker-started load makes its node's copy only; a worker on the other node later
    gets a copy of its own, from the checkpoint the first was loaded from."""
    root = _two_node_sysfs(tmp_path / "sys")
    monkeypatch.setattr(numa_module, "_set_mempolicy", lambda mode, node_ids: None)
    set_id = plan_tables(checkpoint).set_id
    config = in_process_config(
        sock_dir,
        shm_dir,
        numa=Placement.parse("per-node", root),
        allow_roots=[str(checkpoint.parent)],
    )
    with InProcessDaemon(config) as d:
        request = pb.AttachRequest(
            set_id=set_id,
            checkpoint=str(checkpoint),
            pid=os.getpid(),
            accept=[pb.HANDLE_KIND_FD],
            numa_node=1,
        )
        with grpc.insecure_channel(f"unix:{sock_dir / 'd.sock'}") as channel:
            call = pb_grpc.TableServiceStub(channel).Attach(request, timeout=60)
            first = next(e for e in call if e.WhichOneof("event") == "attached").attached
            assert _read_back(first, checkpoint, d).name == f"{set_id}-node1"
            assert {ts.key for ts in d.server.store.sets.all()} == {(set_id, "tmpfs", 1)}
            other, second = _attach(sock_dir / "d.sock", set_id, numa_node=0, checkpoint=checkpoint)
            assert _read_back(second, checkpoint, d).name == f"{set_id}-node0"
            other[1].cancel()
            other[0].close()
            call.cancel()
        reply = d.run(d.server.store.drop(set_id, force=True))
        assert reply[0] == 2 * plan_tables(checkpoint).nbytes
        assert list(set_folders(shm_dir)) == []
        # An operator's load makes every node's copy.
        with grpc.insecure_channel(f"unix:{d.server.config.admin_socket}") as channel:
            events = list(
                pb_grpc.AdminServiceStub(channel).Load(
                    pb.LoadRequest(checkpoint=str(checkpoint)), timeout=60
                )
            )
        assert events[-1].ready.set_id == set_id
        assert sorted(p.name for p in set_folders(shm_dir)) == [
            f"{set_id}-node0",
            f"{set_id}-node1",
        ]


def test_no_copy_of_a_changed_checkpoint_is_made_for_another_node(
    sock_dir: Path, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _two_node_sysfs(tmp_path / "sys")
    monkeypatch.setattr(numa_module, "_set_mempolicy", lambda mode, node_ids: None)
    ckpt = synthesize(tmp_path / "ckpt", SynthSpec(rows=4_000, seed=5))
    set_id = plan_tables(ckpt).set_id
    config = in_process_config(
        sock_dir, shm_dir, numa=Placement.parse("per-node", root), allow_roots=[str(tmp_path)]
    )
    with InProcessDaemon(config) as d:
        request = pb.AttachRequest(
            set_id=set_id,
            checkpoint=str(ckpt),
            pid=os.getpid(),
            numa_node=1,
            # A set a worker's attach loaded goes out as descriptors only.
            accept=[pb.HANDLE_KIND_FD],
        )
        with grpc.insecure_channel(f"unix:{sock_dir / 'd.sock'}") as channel:
            call = pb_grpc.TableServiceStub(channel).Attach(request, timeout=60)
            next(e for e in call if e.WhichOneof("event") == "attached")
            # Rewritten with other contents: the files the node 1 copy came from are gone.
            shutil.rmtree(ckpt)
            synthesize(ckpt, SynthSpec(rows=4_000, seed=6))
            err = attach_error(
                sock_dir / "d.sock",
                pb.AttachRequest(set_id=set_id, checkpoint=str(ckpt), reattach=True, numa_node=0),
            )
            call.cancel()
        assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "differs from the worker's" in (err.details() or "")
        assert {ts.key for ts in d.server.store.sets.all()} == {(set_id, "tmpfs", 1)}


def test_per_node_on_this_one_node_host_is_one_copy(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    """The real kernel and real workers: per-node degenerates to one copy, bound to node 0."""
    d = daemons("--checkpoint", str(checkpoint), "--numa", "per-node", "--backing", "memfd")
    before = shmem_bytes()
    workers += [Worker(checkpoint, d.socket, share="on") for _ in range(2)]
    for w in workers:
        assert w.hello["mode"] == "shared" and w.hello["digests"] == reference_digests(checkpoint)
    [s] = d.status().sets
    assert s.HasField("numa_node") and s.numa_node == 0 and s.lease_count == 2
    wait_until(lambda: d.status().sets[0].locked, 30, "the copy to be locked")
    [s] = d.status().sets
    assert dict(s.bytes_per_node) == {0: s.bytes_per_node[0]} and s.bytes_per_node[0] >= s.bytes
    assert shmem_bytes() - before < 1.5 * s.bytes, "two workers, one copy"
    text = subprocess.run(
        [sys.executable, "-m", "engramd", "status", "--socket", str(d.socket)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert f"{s.set_id}-node0" in text
