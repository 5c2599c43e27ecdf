"""Files opened beneath a root: symlinks followed only inside, no "..", no other mount,
with openat2 and with the O_NOFOLLOW walk older kernels get."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engramd_shared import beneath
from engramd_shared.beneath import OutsideRoot, Root
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import CheckpointError


@pytest.fixture(params=["openat2", "walk"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test with openat2(2) (where the kernel has it) and with the O_NOFOLLOW walk."""
    if request.param == "walk":
        monkeypatch.setattr(beneath, "_has_openat2", False)
    yield request.param


def test_a_walk_stays_beneath_its_root(checkpoint: Path, tmp_path: Path, walk: str) -> None:
    root = tmp_path / "root"
    shutil.copytree(checkpoint, root / "blobs")
    (root / "snap").mkdir()
    for f in (root / "blobs").iterdir():
        (root / "snap" / f.name).symlink_to(f"../blobs/{f.name}")
    (tmp_path / "secret").write_bytes(b"root:*:1")
    (root / "out.safetensors").symlink_to(tmp_path / "secret")
    (root / "up").symlink_to("..")
    os.mkfifo(root / "fifo.safetensors")
    r = Root(root)
    # Symlinks inside the root are followed: the plan is the checkpoint's own.
    plan = plan_tables(root / "snap", beneath=r)
    assert plan.set_id == plan_tables(checkpoint).set_id
    assert all(Path(s.path).parent == root / "blobs" for s in plan.sources)
    assert set(plan.held) == {s.path for s in plan.sources}
    for escape in (root / "out.safetensors", root / "up" / "root" / "snap", root / ".." / "x"):
        with pytest.raises(OutsideRoot, match="outside the allowed root"):
            r.open(escape)
    with pytest.raises(CheckpointError, match="not a regular file"):
        r.open(root / "fifo.safetensors")
    with pytest.raises(OutsideRoot):
        r.open(tmp_path / "secret")


def test_a_walk_does_not_cross_into_another_mount(tmp_path: Path, walk: str) -> None:
    root = tmp_path / "root"
    (root / "bound").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.safetensors").write_bytes(b"\0" * 16)
    bound = subprocess.run(["mount", "--bind", str(tmp_path / "elsewhere"), str(root / "bound")])
    if bound.returncode != 0:
        pytest.skip("bind mounts need root")
    try:
        with pytest.raises(OutsideRoot, match="another mount"):
            Root(root).open(root / "bound" / "a.safetensors")
    finally:
        subprocess.run(["umount", str(root / "bound")], check=True)
