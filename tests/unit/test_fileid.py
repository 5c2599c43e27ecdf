"""A checkpoint file's identity (engramd_shared.fileid) changes with every write."""

from __future__ import annotations

import os
from pathlib import Path

from engramd_shared.fileid import SourceFile


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
