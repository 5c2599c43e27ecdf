"""The pure parts, in-process: sizes, manifests, row ranges, settings, status, backings, policy."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import grpc
import pytest

from conftest import mounted_tmpfs
from engramd.api.wire import set_info, tensor_handle
from engramd.backings import BACKINGS, Backing, MemfdBacking, TmpfsBacking
from engramd.backings.handles import HandleKind
from engramd.backings.memfd import SEALS
from engramd.checksum import digest_fd
from engramd.cli.status_view import as_dict, render
from engramd.config import DaemonConfig
from engramd.errors import CODES, to_status
from engramd.host.fdstore import FdStore
from engramd.host.memlimit import MemoryLimit, memory_limit
from engramd.host.sdnotify import Notifier
from engramd.sets.intents import AttachIntent
from engramd.sets.leases import STATUS_LEASES, Lease
from engramd.sets.policy import LoadPolicy
from engramd.sets.tableset import SetState, TableSet
from engramd.text import escape
from engramd.units import gib, parse_size
from engramd_client.handles import KINDS, MAPPERS
from engramd_client.mapping import Region
from engramd_shared.beneath import OutsideRoot
from engramd_shared.checkpoint import TablePlan, plan_tables
from engramd_shared.config import CUDA_HANDLE_KINDS, DEFAULT_SOCKET, HANDLE_KINDS, ClientConfig
from engramd_shared.errors import (
    BY_REASON,
    BudgetExceeded,
    EngramdError,
    FingerprintMismatch,
    NotAllowed,
    Reason,
    SelectionRefused,
    ShareError,
    ShmCapacityError,
)
from engramd_shared.fileid import SourceFile
from engramd_shared.layout import (
    LOADING_MARK,
    Manifest,
    ManifestError,
    ManifestTensor,
    sets_root,
)
from engramd_shared.pb import engramd_pb2 as pb


def test_sizes() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("200G") == 200 << 30
    assert parse_size("1.5TiB") == 3 << 39
    assert parse_size(" 64 MiB ") == 64 << 20
    with pytest.raises(ValueError, match="examples: 200G"):
        parse_size("lots")
    assert gib(512) == "512 B" and gib(3 << 29) == "1.50 GiB" and gib(2 << 20) == "2.00 MiB"


def _manifest(**changes: object) -> Manifest:
    doc: dict[str, object] = {
        "set_id": "ab" * 10,
        "fingerprint": "f" * 64,
        "nonce": "0" * 32,
        "checkpoint": "/models/x",
        "selection": "*engram.embed.*",
        "created": 1.5,
        "tensors": (ManifestTensor("t", "F8_E4M3", (4, 256), "0000.bin", 0, 1024, "xxh3-64:0"),),
        "sources": (SourceFile("/models/x/a.safetensors", 1, 2, 3, 4, 5),),
    }
    doc.update(changes)
    return Manifest(**doc)  # type: ignore[arg-type]


def test_manifest_round_trip_and_refusals() -> None:
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    legacy = json.loads(m.to_json())
    del legacy["sources"]  # written by engramd 0.1
    assert Manifest.from_json(json.dumps(legacy)).sources == ()
    for broken in (
        {**legacy, "layout_version": 99},
        {k: v for k, v in legacy.items() if k != "nonce"},
        {**legacy, "nonce": "not hex"},
        {**legacy, "tensors": [{**legacy["tensors"][0], "file": "../escape.bin"}]},
        {**legacy, "tensors": [{**legacy["tensors"][0], "dtype": "Q4"}]},
        {**legacy, "sources": [{"path": "/x"}]},
    ):
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(broken))


def test_region_cut_to_rows() -> None:
    r = Region("t", "BF16", (10, 4), "/f", 100, 80)
    assert r.cut(None) is r and r.cut({"other": (0, 1)}) is r
    shard = r.cut({"t": (2, 5)})
    assert (shard.shape, shard.offset, shard.length) == ((3, 4), 100 + 2 * 8, 3 * 8)
    assert r.cut({"t": (4, 4)}).length == 0
    for bad in ((-1, 2), (3, 2), (0, 11)):
        with pytest.raises(ValueError, match="outside the tensor's 10 rows"):
            r.cut({"t": bad})


def test_client_config_from_env() -> None:
    assert ClientConfig.from_env({}) == ClientConfig(socket=DEFAULT_SOCKET, share=None)
    env = {"ENGRAMD_SHARE": "On", "ENGRAMD_SOCKET": "/run/x.sock"}
    assert ClientConfig.from_env(env) == ClientConfig(socket="/run/x.sock", share=True)
    assert ClientConfig.from_env({"ENGRAMD_SHARE": "off"}).share is False
    assert ClientConfig.from_env({"ENGRAMD_FD_SOCKET": "/c/fds"}).fd_socket == "/c/fds"
    assert ClientConfig.from_env({"ENGRAMD_HANDLES": " shm "}).handles == ("shm",)
    assert ClientConfig.from_env({"ENGRAMD_HANDLES": "fabric,shm"}).handles == ("fabric", "shm")
    with pytest.raises(ValueError, match=r"only cuMem kinds.*ENGRAMD_DEVICE"):
        ClientConfig.from_env({"ENGRAMD_HANDLES": "cumem"})
    cumem_only = {"ENGRAMD_HANDLES": "cumem", "ENGRAMD_DEVICE": "cuda:1"}
    assert ClientConfig.from_env(cumem_only).handles == ("cumem",)
    # Every kind a worker may name is a handle kind; those of host memory have their mapper.
    assert tuple(KINDS) == HANDLE_KINDS
    assert set(MAPPERS) == set(HANDLE_KINDS) - set(CUDA_HANDLE_KINDS)
    with pytest.raises(ValueError, match="use cumem,fabric,fd,shm"):
        ClientConfig.from_env({"ENGRAMD_HANDLES": "cuda"})
    # Arguments win over the environment.
    assert ClientConfig.from_env(env, socket="/y", share=False) == ClientConfig("/y", False)
    with pytest.raises(ValueError, match="use auto, on or off"):
        ClientConfig.from_env({"ENGRAMD_SHARE": "maybe"})


def test_status_is_bounded_and_prints_safely() -> None:
    ts = TableSet(
        set_id="ab" * 10,
        checkpoint="/models/evil\n    lease forged",
        selection="*",
        fingerprint="f",
        nbytes=1 << 30,
        ntensors=2,
        backing=TmpfsBacking("/dev/shm", None),
        state=SetState.READY,
    )
    for i in range(STATUS_LEASES + 5):
        lease = Lease(
            f"l{i}",
            ts.set_id,
            "tmpfs",
            node=None,
            pid=100 + i,
            labels={"rank": str(i)},
            pid_start=None,
        )
        ts.leases[lease.lease_id] = lease
    ts.leases["l0"].stale = True
    info = set_info(ts)
    assert len(info.leases) == STATUS_LEASES and info.lease_count == STATUS_LEASES + 5
    assert info.state == "ready" and info.backing == "tmpfs"
    assert info.leases[0].stale and not info.leases[0].pid_verified
    reply = pb.StatusReply(daemon=pb.DaemonInfo(), shm=pb.ShmInfo(total_bytes=1 << 40), sets=[info])
    doc = as_dict(reply)
    assert doc["shm"]["total_bytes"] == 1 << 40  # a number, not protobuf's string
    assert doc["saved_bytes"] == (STATUS_LEASES + 4) << 30  # counted over every lease
    text = render(reply)
    assert "evil\\x0a    lease forged" in text
    assert not any(line.startswith("    lease forged") for line in text.splitlines())
    assert "and 5 more leases" in text and "STALE" in text
    assert escape("a\tb\x1b[2J\x85") == "a\\x09b\\x1b[2J\\x85"


def test_every_reason_names_one_class_and_one_status() -> None:
    def family(cls: type[EngramdError]) -> list[type[EngramdError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in family(sub))]

    # A worker raises the daemon's own class for each refusal, and it is a ShareError:
    # auto mode loads its own tables instead.
    refusals = [c for c in family(ShareError) if "reason" in vars(c)]
    reasons = [c.reason for c in refusals]
    assert len(reasons) == len(set(reasons)), "two errors share a reason"
    assert all(BY_REASON[c.reason] is c for c in refusals)
    assert set(CODES) == set(Reason), "a reason without a gRPC status (engramd/errors.py CODES)"
    assert {c.reason for c in family(EngramdError)} <= set(Reason)
    assert BY_REASON[Reason.BUDGET] is BudgetExceeded and issubclass(
        BudgetExceeded, ShmCapacityError
    )
    assert Reason.CHECKPOINT not in BY_REASON and Reason.INTERNAL not in BY_REASON
    assert to_status(OutsideRoot("x"))[:2] == (
        grpc.StatusCode.PERMISSION_DENIED,
        Reason.NOT_ALLOWED,
    )


def test_tmpfs_backing_bookkeeping(checkpoint: Path) -> None:
    with mounted_tmpfs("64m") as shm_dir:
        _bookkeeping(checkpoint, shm_dir)


def _bookkeeping(checkpoint: Path, shm_dir: Path) -> None:
    assert BACKINGS["tmpfs"] is TmpfsBacking
    # The shm folder's own pages; a huge-page root's bookkeeping: test_huge_default.
    config = DaemonConfig(shm_dir=str(shm_dir), huge_tmpfs=False)
    backing = TmpfsBacking.from_config(config, None, _NO_FD_STORE)
    backing.claim()
    (shm_dir / "other-writer").write_bytes(b"\1" * (8 << 20))
    usage = backing.usage()
    assert usage.where == str(shm_dir) and usage.page_size in (4096, 2 << 20)
    assert usage.total == 64 << 20 and usage.free <= 56 << 20
    assert backing.reserved(1) == usage.page_size and backing.reserved(0) == 0
    with pytest.raises(ShmCapacityError, match="in all"):
        backing.check_capacity(usage.total + 1, "set x")
    with pytest.raises(ShmCapacityError, match="free"):
        backing.check_capacity(usage.free + (1 << 20), "set x")
    backing.check_capacity(usage.free + (1 << 20), "set x", reclaimable=2 << 20)
    (shm_dir / "other-writer").unlink()

    plan = plan_tables(checkpoint)
    abandoned = backing.stage(plan)
    [staging] = sets_root(shm_dir).iterdir()
    assert staging.name.startswith(plan.set_id + LOADING_MARK)
    abandoned.discard()
    assert list(sets_root(shm_dir).iterdir()) == []
    manifest = _copy_in(backing, plan)
    sums = [t.checksum for t in manifest.tensors]
    (sets_root(shm_dir) / f"{'cd' * 10}{LOADING_MARK}1-x").mkdir()  # an interrupted load
    (sets_root(shm_dir) / "junk").mkdir()
    assert backing.adopt() == [manifest]
    assert [p.name for p in sets_root(shm_dir).iterdir()] == [plan.set_id]
    assert [backing.checksum(manifest, i) for i in range(len(sums))] == sums
    [handle, *_] = (tensor_handle(h) for h in backing.handles(manifest, HandleKind.SHM))
    assert handle.WhichOneof("handle") == "shm" and handle.shm.set_dir.endswith(plan.set_id)
    assert handle.kind == pb.HANDLE_KIND_SHM
    _check_descriptors(backing, manifest, plan)
    backing.remove(plan.set_id)
    assert list(sets_root(shm_dir).iterdir()) == []


#: No systemd here: the fd store is off.
_NO_FD_STORE = FdStore(Notifier(address=""), env={})


def _copy_in(backing: Backing, plan: TablePlan) -> Manifest:
    """Stage, fill and publish the plan's set the way the loader does, in this thread."""
    staged = backing.stage(plan)
    sums = []
    for i, t in enumerate(plan.tensors):
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            staged.write(i, memoryview(f.read(t.nbytes)), 0)
            sums.append(digest_fd(f.fileno(), t.offset, t.nbytes))
    manifest = _manifest(
        set_id=plan.set_id,
        tensors=tuple(
            ManifestTensor(t.name, t.dtype, t.shape, *staged.placement(i), t.nbytes, sums[i])
            for i, t in enumerate(plan.tensors)
        ),
    )
    staged.publish(manifest)
    return manifest


def _check_descriptors(backing: Backing, manifest: Manifest, plan: TablePlan) -> None:
    """Each tensor's bytes, read through the backing's read-only descriptors, are the plan's."""
    opened = dict(backing.descriptors(manifest))
    try:
        handles = [tensor_handle(h) for h in backing.handles(manifest, HandleKind.FD)]
        for handle, t in zip(handles, plan.tensors, strict=True):
            assert handle.kind == pb.HANDLE_KIND_FD
            fd = opened[handle.fd.file]
            with open(t.file, "rb") as f:
                f.seek(t.offset)
                assert os.pread(fd, handle.fd.length, handle.fd.offset) == f.read(t.nbytes)
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    finally:
        for fd in opened.values():
            os.close(fd)


def test_memfd_backing_bookkeeping(checkpoint: Path) -> None:
    backing = MemfdBacking.from_config(DaemonConfig(), None, _NO_FD_STORE)
    backing.claim()
    assert not backing.survives_restart and backing.handle_kinds == {HandleKind.FD}
    usage = backing.usage()
    assert usage.total >= usage.free > 0 and usage.used == 0
    with pytest.raises(ShmCapacityError, match="in all"):
        backing.check_capacity(usage.total + 1, "set x")
    plan = plan_tables(checkpoint)
    backing.stage(plan).discard()
    manifest = _copy_in(backing, plan)
    # Tensors share one memfd, each at a page-aligned offset.
    assert {t.file for t in manifest.tensors} == {"tables"}
    assert all(t.offset % backing.page_size == 0 for t in manifest.tensors)
    assert backing.usage().used == sum(backing.reserved(t.nbytes) for t in plan.tensors)
    assert [backing.checksum(manifest, i) for i in range(len(plan.tensors))] == [
        t.checksum for t in manifest.tensors
    ]
    _check_descriptors(backing, manifest, plan)
    [(_, fd)] = backing.descriptors(manifest)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
        # Sealed: not even a writable descriptor of the same memfd may change it.
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    assert backing.adopt() == []  # nothing passed by an fd store
    backing.remove(plan.set_id)
    assert backing.usage().used == 0
    with pytest.raises(ManifestError, match="no longer held"):
        backing.descriptors(manifest)


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


def test_load_policy(checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    policy = LoadPolicy(DaemonConfig(allow_roots=[str(root)], checkpoints=[str(checkpoint)]))
    inside = AttachIntent(set_id="0" * 20, checkpoint=str(root / "m"))
    path, beneath = policy.check_request(inside, loaded=[])
    # Under a root: the path as written, its files to be opened beneath that root.
    assert path == root / "m" and beneath is not None and beneath.path == root
    with pytest.raises(SelectionRefused):
        policy.check_request(
            AttachIntent(set_id="0" * 20, checkpoint=str(root / "m"), tensors="*"), []
        )
    with pytest.raises(NotAllowed, match="allowed roots"):
        policy.check_request(
            AttachIntent(set_id="0" * 20, checkpoint=str(tmp_path / "elsewhere")), []
        )
    # A configured checkpoint whose files differ from the loaded copy: changed on disk.
    configured = AttachIntent(set_id="0" * 20, checkpoint=str(checkpoint))
    with pytest.raises(FingerprintMismatch, match="changed on disk"):
        policy.check_request(configured, loaded=[str(checkpoint.resolve())])
    plan = plan_tables(checkpoint)
    policy.check_plan(checkpoint.resolve(), plan, plan.set_id)
    with pytest.raises(FingerprintMismatch) as info:
        policy.check_plan(checkpoint.resolve(), plan, "1" * 20)
    assert plan.set_id not in str(info.value)


def test_source_identity_sees_a_rewrite(tmp_path: Path) -> None:
    f = tmp_path / "a.safetensors"
    f.write_bytes(b"x" * 100)
    os.utime(f, ns=(1, 1))  # an old mtime: any write now sets another
    before = SourceFile.of(f, os.stat(f))
    assert SourceFile.of(f, os.stat(f)) == before
    with open(f, "r+b") as out:
        out.write(b"y")
    after = SourceFile.of(f, os.stat(f))
    assert after.same_inode(before) and after != before
