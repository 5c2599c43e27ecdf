"""The tmpfs and memfd backings in-process: capacity, staging, adoption, handles, seals."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from backing_fill import NO_FD_STORE, check_descriptors, copy_in

from conftest import mounted_tmpfs
from engramd.api.wire import tensor_handle
from engramd.backings import BACKINGS, MemfdBacking, TmpfsBacking
from engramd.backings.handles import HandleKind
from engramd.backings.memfd import SEALS
from engramd.config import DaemonConfig
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import (
    DIRECT_ALIGN,
    LOADING_MARK,
    ManifestError,
    extents,
    lead,
    sets_root,
)
from engramd_shared.pb import engramd_pb2 as pb
from helpers import set_folders


def test_tmpfs_backing_bookkeeping(checkpoint: Path) -> None:
    with mounted_tmpfs("64m") as shm_dir:
        _bookkeeping(checkpoint, shm_dir)


def _bookkeeping(checkpoint: Path, shm_dir: Path) -> None:
    assert BACKINGS["tmpfs"] is TmpfsBacking
    # The shm folder's own pages; a huge-page root's bookkeeping: test_huge_default.
    config = DaemonConfig(shm_dir=str(shm_dir), huge_tmpfs=False)
    backing = TmpfsBacking.from_config(config, None, NO_FD_STORE)
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
    [staging] = set_folders(shm_dir)
    assert staging.name.startswith(plan.set_id + LOADING_MARK)
    abandoned.discard()
    assert list(set_folders(shm_dir)) == []
    manifest = copy_in(backing, plan)
    sums = [t.checksum for t in manifest.tensors]
    (sets_root(shm_dir) / f"{'cd' * 10}{LOADING_MARK}1-x").mkdir()  # an interrupted load
    (sets_root(shm_dir) / "junk").mkdir()
    assert backing.adopt() == [manifest]
    assert [p.name for p in set_folders(shm_dir)] == [plan.set_id]
    assert [backing.checksum(manifest, i) for i in range(len(sums))] == sums
    [handle, *_] = (tensor_handle(h) for h in backing.handles(manifest, HandleKind.SHM))
    assert handle.WhichOneof("handle") == "shm" and handle.shm.set_dir.endswith(plan.set_id)
    assert handle.kind == pb.HANDLE_KIND_SHM
    check_descriptors(backing, manifest, plan)
    backing.remove(plan.set_id)
    assert list(set_folders(shm_dir)) == []


def test_memfd_backing_bookkeeping(checkpoint: Path) -> None:
    backing = MemfdBacking.from_config(DaemonConfig(), None, NO_FD_STORE)
    backing.claim()
    assert not backing.survives_restart and backing.handle_kinds == {HandleKind.FD}
    usage = backing.usage()
    assert usage.total >= usage.free > 0 and usage.used == 0
    with pytest.raises(ShmCapacityError, match="in all"):
        backing.check_capacity(usage.total + 1, "set x")
    plan = plan_tables(checkpoint)
    backing.stage(plan).discard()
    manifest = copy_in(backing, plan)
    # Tensors share one memfd, each in pages of its own at its offset in the checkpoint
    # within a page (for direct reads).
    assert {t.file for t in manifest.tensors} == {"tables"}
    for placed, planned in zip(manifest.tensors, plan.tensors, strict=True):
        assert placed.offset % DIRECT_ALIGN == planned.offset % DIRECT_ALIGN == lead(planned)
        assert (placed.offset - lead(planned)) % backing.page_size == 0
    assert backing.usage().used == sum(map(backing.reserved, extents(plan.tensors)))
    assert [backing.checksum(manifest, i) for i in range(len(plan.tensors))] == [
        t.checksum for t in manifest.tensors
    ]
    check_descriptors(backing, manifest, plan)
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
