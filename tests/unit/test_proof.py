"""Prover (engramd.sets.proof): a checkpoint's files judged and proven against a held set's
strong digests, on real files: on a disk that stamps every write, and on tmpfs, which does
not; and a copy forged to keep every XXH3 checksum is found."""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from backing_fill import sample_manifest
from xxh3_forge import forge

from engramd.checksum import CHECKSUM
from engramd.host.hugeroot import remove_shm_folder
from engramd.sets.loader import LoadProgress
from engramd.sets.proof import Prover, stamps_writes
from engramd.strong import STRONG, digest_fd_as
from engramd_shared.checkpoint import TablePlan, plan_tables
from engramd_shared.errors import CheckpointError, FingerprintMismatch
from engramd_shared.headers import TensorEntry
from engramd_shared.layout import Manifest, ManifestTensor

#: Each held set's strong digests by tensor name, as SetStore.strong_digests gives them,
#: by the set's manifest's nonce: taken from the files when "loaded", before a test changes them.
HELD: dict[str, dict[str, str]] = {}


def _digest(t: TensorEntry, like: str) -> str:
    fd = os.open(t.file, os.O_RDONLY)
    try:
        return digest_fd_as(fd, t.offset, t.nbytes, like)
    finally:
        os.close(fd)


def loaded_from(plan: TablePlan, filled_as: str = "") -> Manifest:
    """The manifest of the set a load of `plan` makes: each tensor's checksum, the files;
    with `filled_as` (a strong digest's kind), a set a fill landed, which keeps its strong
    digests of that kind."""
    tensors = []
    strong = {t.name: _digest(t, f"{filled_as or STRONG}:") for t in plan.tensors}
    for i, t in enumerate(plan.tensors):
        checksum = _digest(t, f"{CHECKSUM}:")
        tensors.append(
            ManifestTensor(t.name, t.dtype, t.shape, f"{i:04}.bin", 0, t.nbytes, checksum)
        )
    manifest = sample_manifest(
        set_id=plan.set_id,
        checkpoint=str(plan.checkpoint),
        tensors=tuple(tensors),
        sources=plan.sources,
        nonce=secrets.token_hex(16),
        strong_digests=tuple(strong.values()) if filled_as else None,
    )
    HELD[manifest.nonce] = strong
    return manifest


def flip_byte(t: TensorEntry, at: int = 0) -> None:
    """Change one byte of the tensor's data in its file, in place."""
    with open(t.file, "r+b") as f:
        f.seek(t.offset + at)
        old = f.read(1)
        f.seek(t.offset + at)
        f.write(bytes([old[0] ^ 0xFF]))


def proven(prover: Prover, plan: TablePlan, manifest: Manifest) -> int:
    """Judge and prove `plan` against the set; the bytes the proof read."""
    proof = prover.judge(plan, manifest)
    progress = LoadProgress(proof.nbytes)
    prover.prove(proof, manifest, HELD[manifest.nonce], progress)
    assert progress.done == proof.nbytes
    return progress.done


@pytest.fixture
def ours(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint on a disk's filesystem, for this test to change."""
    assert stamps_writes(str(tmp_path)), "tmp_path must be on a filesystem that stamps writes"
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


@pytest.fixture
def on_tmpfs(checkpoint: Path) -> Iterator[Path]:
    """A copy of the checkpoint under /dev/shm (tmpfs: writes there stamp nothing)."""
    folder = Path(tempfile.mkdtemp(prefix="engramd-test-proof-", dir="/dev/shm"))
    yield Path(shutil.copytree(checkpoint, folder / "ckpt"))
    remove_shm_folder(folder)


def test_the_sets_own_unchanged_files_are_proven_without_a_read(ours: Path) -> None:
    plan = plan_tables(ours)
    manifest = loaded_from(plan)
    proof = Prover().judge(plan, manifest)
    assert proof.unproven == () and proof.nbytes == 0
    assert proof.stamped == frozenset(plan.sources)
    assert proven(Prover(), plan, manifest) == 0


def test_a_copy_is_read_once_then_proven_by_its_kept_digests(ours: Path, tmp_path: Path) -> None:
    manifest = loaded_from(plan_tables(ours))
    copy = plan_tables(shutil.copytree(ours, tmp_path / "copy"))
    assert copy.set_id == manifest.set_id and copy.sources != manifest.sources
    prover = Prover()
    assert prover.judge(copy, manifest).nbytes == copy.nbytes > 0
    assert proven(prover, copy, manifest) == copy.nbytes
    # The same files again: every tensor is still unproven by identity, but its digest is kept.
    again = prover.judge(copy, manifest)
    assert len(again.unproven) == len(copy.tensors) and again.nbytes == 0
    assert proven(prover, copy, manifest) == 0
    # A prover that keeps one digest reads all but the last tensor again.
    small = Prover(kept=1)
    proven(small, copy, manifest)
    assert small.judge(copy, manifest).nbytes == copy.nbytes - copy.tensors[-1].nbytes


def test_a_changed_byte_in_a_copy_is_found(ours: Path, tmp_path: Path) -> None:
    manifest = loaded_from(plan_tables(ours))
    copy = tmp_path / "copy"
    shutil.copytree(ours, copy)
    victim = plan_tables(copy).tensors[-1]
    flip_byte(victim, at=victim.nbytes // 2)
    changed = plan_tables(copy)
    # Headers and samples are the same: the set id does not see the byte.
    assert changed.set_id == manifest.set_id
    with pytest.raises(FingerprintMismatch, match="does not hold the bytes") as info:
        proven(Prover(), changed, manifest)
    assert repr(victim.name) in str(info.value) and manifest.set_id not in str(info.value)


def test_a_copy_forged_to_keep_every_xxh3_checksum_is_found(ours: Path, tmp_path: Path) -> None:
    """XXH3's lane arithmetic: a word set to POISONED in a tensor's piece, the piece's XXH3
    unchanged, so every checksum of the set is too; the strong digest finds it."""
    manifest = loaded_from(plan_tables(ours))
    copy = tmp_path / "forged"
    shutil.copytree(ours, copy)
    victim = max(plan_tables(copy).tensors, key=lambda t: t.nbytes)
    assert victim.nbytes > 3 * (2 << 20)
    at = forge(victim.file, victim.offset, 1, b"POISONED")
    assert victim.file.read_bytes()[at : at + 8] == b"POISONED"
    forged = plan_tables(copy)
    assert forged.set_id == manifest.set_id
    assert [_digest(t, f"{CHECKSUM}:") for t in forged.tensors] == [
        t.checksum for t in manifest.tensors
    ]
    with pytest.raises(FingerprintMismatch, match="does not hold the bytes") as info:
        proven(Prover(), forged, manifest)
    assert repr(victim.name) in str(info.value)


def test_a_loaded_file_changed_in_place_is_named_as_changed_on_disk(ours: Path) -> None:
    manifest = loaded_from(plan_tables(ours))
    flip_byte(plan_tables(ours).tensors[0], at=1)
    changed = plan_tables(ours)
    proof = Prover().judge(changed, manifest)
    # Only the tensors of the rewritten file lost their proof by identity.
    kept = set(manifest.sources)
    rewritten = {s.path for s in changed.sources if s not in kept}
    assert rewritten == {str(changed.tensors[0].file)}
    assert {str(t.file) for t in proof.unproven} == rewritten
    with pytest.raises(FingerprintMismatch, match="changed on disk after engramd loaded it"):
        Prover().prove(proof, manifest, HELD[manifest.nonce], LoadProgress(proof.nbytes))


def test_a_file_still_being_written_is_refused_not_proven(ours: Path, tmp_path: Path) -> None:
    manifest = loaded_from(plan_tables(ours))
    copy = plan_tables(shutil.copytree(ours, tmp_path / "copy"))
    # Written after its headers were read (a download or a save not yet done).
    with open(copy.tensors[0].file, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(CheckpointError, match="changed since its headers were read"):
        proven(Prover(), copy, manifest)
    # Nothing of the half-written file was kept: once final, it is read and proven in full.
    final = plan_tables(copy.checkpoint)
    assert Prover().judge(final, manifest).nbytes == final.nbytes


def test_files_on_tmpfs_are_digested_at_every_attach(on_tmpfs: Path) -> None:
    assert not stamps_writes(str(on_tmpfs))
    plan = plan_tables(on_tmpfs)
    manifest = loaded_from(plan)
    prover = Prover()
    # The set's own files, unchanged, prove nothing there: a write through a mapping
    # changes neither mtime nor ctime.
    assert prover.judge(plan, manifest).stamped == frozenset()
    assert proven(prover, plan, manifest) == plan.nbytes
    assert proven(prover, plan, manifest) == plan.nbytes
    # And a byte changed that way is found although the identity is the same.
    victim = plan.tensors[0]
    with open(victim.file, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[victim.offset] ^= 0xFF
    assert plan_tables(on_tmpfs).sources == plan.sources
    with pytest.raises(FingerprintMismatch, match="changed on disk"):
        proven(prover, plan, manifest)
