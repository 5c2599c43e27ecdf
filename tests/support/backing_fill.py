"""Filling a backing in-process the way the loader does, and reading it back (tests/unit,
tests/daemon/test_hugetlbfs.py)."""

from __future__ import annotations

import fcntl
import os

from engramd.api.wire import tensor_handle
from engramd.backings import Backing
from engramd.backings.handles import HandleKind
from engramd.checksum import digest_fd
from engramd.host.fdstore import FdStore
from engramd.host.sdnotify import Notifier
from engramd_shared.checkpoint import TablePlan
from engramd_shared.fileid import SourceFile
from engramd_shared.layout import Manifest, ManifestTensor
from engramd_shared.pb import engramd_pb2 as pb

#: No systemd here: the fd store is off.
NO_FD_STORE = FdStore(Notifier(address=""), env={})


def sample_manifest(**changes: object) -> Manifest:
    """A valid manifest of one tensor, with `changes` to its fields."""
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


def copy_in(backing: Backing, plan: TablePlan) -> Manifest:
    """Stage, fill and publish the plan's set the way the loader does, in this thread."""
    staged = backing.stage(plan)
    sums = []
    for i, t in enumerate(plan.tensors):
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            staged.write(i, memoryview(f.read(t.nbytes)), 0)
            sums.append(digest_fd(f.fileno(), t.offset, t.nbytes))
    manifest = sample_manifest(
        set_id=plan.set_id,
        tensors=tuple(
            ManifestTensor(t.name, t.dtype, t.shape, *staged.placement(i), t.nbytes, sums[i])
            for i, t in enumerate(plan.tensors)
        ),
    )
    staged.publish(manifest)
    return manifest


def check_descriptors(backing: Backing, manifest: Manifest, plan: TablePlan) -> None:
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
