"""The fleet's keys, proofs and attestations (engramd/fleet/trust.py), and the token file's
checks; the manifest's attestation and strong digests; what a receiver compares."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from engramd.fleet.base import SourceFailed
from engramd.fleet.trust import (
    OBJECT_HEADER_BYTES,
    AttestedManifest,
    AttestedTensor,
    FleetKey,
    attest_checkpoint,
    check_received,
    manifest_key,
    read_token,
)
from engramd.strong import digest_views
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.layout import Manifest, ManifestError, ManifestTensor

TOKEN = "unit-token-0123456789abcdef"
SET = "0123456789abcdef0123"
STRONG_A, STRONG_B, OTHER = (f"blake3-pieces:{c * 64}" for c in "abc")
TENSORS = (
    AttestedTensor("a.weight", "F8_E4M3", (4, 256), 1024, "xxh3-64:00000000000000aa", STRONG_A),
    AttestedTensor("b.weight", "F8_E4M3", (8, 256), 2048, "xxh3-64:00000000000000bb", STRONG_B),
)
STRONG = [STRONG_A, STRONG_B]


def test_proofs_need_the_token_and_bind_every_input() -> None:
    """A proof is the token holder's alone, and names its set and both nonces; the server's
    and the receiver's proofs are under different keys, so neither stands for the other."""
    key, other = FleetKey(TOKEN), FleetKey(TOKEN + "x")
    n1, n2 = os.urandom(32), os.urandom(32)
    proof = key.server_proof(SET, n1, n2)
    assert proof == FleetKey(TOKEN).server_proof(SET, n1, n2)
    assert proof != other.server_proof(SET, n1, n2)
    assert proof != key.client_proof(SET, n1, n2)
    assert proof != key.server_proof(SET, n2, n1)
    assert proof != key.server_proof("f" * 20, n1, n2)
    assert TOKEN.encode() not in proof and len(proof) == 32


def test_an_attestation_covers_every_digest_and_field() -> None:
    key = FleetKey(TOKEN)
    sealed = key.attest(SET, "fp", TENSORS, STRONG)
    assert sealed.startswith("hmac-sha256:")
    assert key.attested(sealed, SET, "fp", TENSORS, STRONG)
    assert not FleetKey(TOKEN + "x").attested(sealed, SET, "fp", TENSORS, STRONG)
    changed = [
        (SET, "fp", (replace(TENSORS[0], checksum="xxh3-64:00000000000000ab"), TENSORS[1]), STRONG),
        (SET, "fp", (replace(TENSORS[0], shape=(256, 4)), TENSORS[1]), STRONG),
        (SET, "fp", (replace(TENSORS[0], name="c.weight"), TENSORS[1]), STRONG),
        (SET, "fp", (replace(TENSORS[0], dtype="BF16"), TENSORS[1]), STRONG),
        (SET, "fp", (replace(TENSORS[0], nbytes=1025), TENSORS[1]), STRONG),
        (SET, "fp", TENSORS[:1], STRONG[:1]),
        (SET, "fp2", TENSORS, STRONG),
        ("f" * 20, "fp", TENSORS, STRONG),
        # The same XXH3 checksums, another strong digest: what bytes built to share a
        # tensor's XXH3 would have.
        (SET, "fp", TENSORS, [OTHER, STRONG_B]),
        (SET, "fp", TENSORS, [STRONG_B, STRONG_A]),
        (SET, "fp", TENSORS, STRONG[:1]),
        (SET, "fp", TENSORS, []),
        (SET, "fp", TENSORS, [STRONG_A, STRONG_B.upper()]),
    ]
    for set_id, fingerprint, tensors, strong in changed:
        assert not key.attested(sealed, set_id, fingerprint, tensors, strong)


def test_an_offer_with_the_genuine_checksums_and_another_strong_digest_is_not_attested() -> None:
    """An offer built by hand: the real manifest (XXH3 checksums) and the real attestation,
    one strong digest replaced, as a rogue whose bytes share the genuine XXH3 would send;
    and an attested manifest object with the same change."""
    key = FleetKey(TOKEN)
    real = AttestedManifest(SET, "fp", TENSORS, key.attest(SET, "fp", TENSORS, STRONG))
    assert key.attested(real.attestation, SET, "fp", real.tensors, STRONG)
    forged = replace(real, tensors=(replace(TENSORS[0], strong=OTHER), TENSORS[1]))
    back = AttestedManifest.from_body(forged.to_bytes()[OBJECT_HEADER_BYTES:])
    assert [t.checksum for t in back.tensors] == [t.checksum for t in TENSORS]
    assert not key.attested(
        back.attestation, SET, "fp", back.tensors, [t.strong for t in back.tensors]
    )
    # An attestation of checksums alone (v1) stands for no set of strong digests.
    assert not key.attested(real.attestation, SET, "fp", TENSORS, [])


def test_received_bytes_must_have_the_attested_strong_digests() -> None:
    names = [t.name for t in TENSORS]
    check_received(names, STRONG, STRONG, "the peer sent other bytes")
    with pytest.raises(SourceFailed) as e:
        check_received(names, STRONG, [STRONG_A, OTHER], "the peer sent other bytes")
    assert str(e.value) == (
        f"tensor 'b.weight' arrived with strong digest {OTHER}, the attested one is "
        f"{STRONG_B}: the peer sent other bytes"
    )


def test_an_attested_manifest_object_round_trips(tmp_path: Path) -> None:
    """The object store's manifest: a fixed-size header naming the JSON's length, the JSON."""
    ckpt = synthesize(tmp_path / "c", SynthSpec(rows=64))
    plan = plan_tables(ckpt)
    made = attest_checkpoint(plan, FleetKey(TOKEN))
    data = made.to_bytes()
    n = AttestedManifest.body_length(data[:OBJECT_HEADER_BYTES])
    assert len(data) == OBJECT_HEADER_BYTES + n
    back = AttestedManifest.from_body(data[OBJECT_HEADER_BYTES:])
    assert back == made
    assert data.startswith(b"engramd-manifest-v2 ")
    assert FleetKey(TOKEN).attested(
        back.attestation,
        back.set_id,
        back.fingerprint,
        back.tensors,
        [t.strong for t in back.tensors],
    )
    # Both digests are the files' bytes' (as the set's pages hold them).
    views = []
    for t in plan.tensors:
        data_of = b"".join(s.file.read_bytes()[s.offset : s.offset + s.nbytes] for s in t.spans)
        views.append(memoryview(data_of))
    both = digest_views(views)
    assert [t.checksum for t in made.tensors] == both.checksums
    assert [t.strong for t in made.tensors] == both.strong
    assert manifest_key("m/x", plan.set_id) == f"m/x/engramd-manifest-{plan.set_id}.json"
    for bad in (
        b"x" * OBJECT_HEADER_BYTES,
        data[: OBJECT_HEADER_BYTES - 1],
        b"engramd-manifest-v2 0",
        # Another magic, whatever its format: one header is read.
        b"engramd-manifest-v1 " + data[len(b"engramd-manifest-v1 ") : OBJECT_HEADER_BYTES],
    ):
        with pytest.raises(ValueError):
            AttestedManifest.body_length(bad)


def test_the_manifest_keeps_an_attestation_and_reads_older_ones() -> None:
    t = ManifestTensor("a", "F8_E4M3", (4, 256), "0000.bin", 0, 1024, "xxh3-64:00000000000000aa")
    m = Manifest(SET, "fp", "0" * 32, "/c", "auto", 1.0, (t,))
    assert "attestation" not in m.to_json() and "strong_digests" not in m.to_json()
    assert Manifest.from_json(m.to_json()).attestation is None
    assert Manifest.from_json(m.to_json()).strong_digests is None
    signed = replace(m, attestation="hmac-sha256:" + "ab" * 32, strong_digests=(STRONG_A,))
    assert Manifest.from_json(signed.to_json()) == signed
    # A set filled by an engramd that attested checksums alone still reads (and adopts).
    older = replace(m, attestation="hmac-sha256:" + "ab" * 32)
    assert Manifest.from_json(older.to_json()).strong_digests is None
    doc = json.loads(signed.to_json())
    for bad in ([STRONG_A, STRONG_B], STRONG_A, [1]):
        with pytest.raises(ManifestError, match="malformed strong digests"):
            Manifest.from_json(json.dumps({**doc, "strong_digests": bad}))


def _token(folder: Path, mode: int, folder_mode: int = 0o700) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    folder.chmod(folder_mode)
    return path


@pytest.mark.parametrize("mode", [0o400, 0o600])
def test_a_token_only_its_owner_reads_is_taken(tmp_path: Path, mode: int) -> None:
    assert read_token(str(_token(tmp_path / "t", mode))) == TOKEN


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o420])
def test_a_token_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = _token(tmp_path / "t", mode)
    with pytest.raises(ValueError) as e:
        read_token(str(path))
    assert f"{path} has mode {mode:04o}" in str(e.value)
    assert f"`chmod 0400 {path}`" in str(e.value)


@pytest.mark.parametrize("folder_mode", [0o777, 0o770, 0o702])
def test_a_token_in_a_folder_others_may_write_is_refused(tmp_path: Path, folder_mode: int) -> None:
    path = _token(tmp_path / "t", 0o400, folder_mode)
    with pytest.raises(ValueError) as e:
        read_token(str(path))
    assert f"the folder {path.parent} has mode {folder_mode:04o}" in str(e.value)


def test_a_sticky_folder_and_a_symlink_are_taken(tmp_path: Path) -> None:
    """/tmp's rule (others cannot replace what is not theirs) and a Secret's `..data` link:
    the file the link leads to is judged, in its own folders."""
    path = _token(tmp_path / "t", 0o400, 0o1777)
    assert read_token(str(path)) == TOKEN
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_token(str(link)) == TOKEN


def test_a_token_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="is not a regular file"):
        read_token(str(fifo))
    assert stat.S_ISFIFO(fifo.stat().st_mode)
