"""Who the fleet trusts (issue 43, items 4 and 8): a rogue peer with the public checkpoint, a
relay that offers its own bytes under a real daemon's offer, a bucket with one altered row, a
token on one side only, token files others may read, and a filled set's attestation carried
to the next hop. Real daemons in network namespaces.

The rogue (tests/support/rogue_peer.py) runs in namespace A under `ip netns
exec`, holds only the checkpoint's files, zeroes one 256-byte row of its
copy and offers it with XXH3 digests of the altered bytes: the attack that
published the row on a27fef5; or it relays the handshake to a real daemon
and offers its copy under the real offer's digests and attestation. The
receiver runs in namespace B.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import daemon.test_fleet as fleet
import pytest
from fleet_nodes import (
    TOKEN,
    checkpoint_digests,
    ready_set,
    receiving,
    rogue_peer,
    serving,
    set_digests,
    write_token,
)

from conftest import SUPPORT
from engramd.fleet.trust import FleetKey, attest_checkpoint
from engramd.strong import PIECE_BYTES, STRONG
from engramd_shared.checkpoint import plan_tables
from engramd_shared.headers import SAMPLE_BYTES, SAMPLES
from engramd_shared.layout import Manifest, sets_root
from engramd_shared.pb import peer_pb2
from fleet_lab import S3, Net
from helpers import engramd

pytestmark = fleet.pytestmark
# The object-store tests' s3rver (the namespace pair, nodes and token file are
# tests/support/fleet_nodes.py's, for every test).
s3 = fleet.s3

OTHER_TOKEN = "another-token-0123456789abcdef"


def manifest_of(shm_dir: Path, set_id: str) -> Manifest:
    return Manifest.from_json((sets_root(shm_dir) / set_id / "manifest.json").read_text())


def strong_of(checkpoint: Path) -> list[str]:
    """Each tensor's strong digest as `engramd manifest` takes it from the files."""
    made = attest_checkpoint(plan_tables(checkpoint), FleetKey(TOKEN))
    return [t.strong for t in made.tensors]


# -- a rogue endpoint at a --peers address ------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "forged"])
def test_a_rogue_peer_with_the_public_checkpoint_learns_nothing_and_is_refused(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, mode: str
) -> None:
    """The rogue offers its altered copy at once (the old protocol) or after a proof it
    forged: the receiver sends it nothing but its FillOpen (no token, no proof of its own),
    logs why, and loads from its files, without the zeroed row."""
    with rogue_peer(net, checkpoint, 7077, mode) as (rogue, _):
        b = nodes("b")
        rb = receiving(b, checkpoint, net, token_file)
        s = ready_set(rb)
        captured = rogue.ask("captured")
    assert s.source == "files", rb.log
    assert f"peer {net.ip_a}:7077 could not prove it holds the fleet's token; refused" in rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
    # All the rogue got: one FillOpen with the set id and a fresh nonce.
    assert captured["kinds"] == ["open"], captured
    raw = [bytes.fromhex(h) for h in captured["requests"]]
    opened = peer_pb2.FillRequest.FromString(raw[0]).open
    assert opened.set_id == s.set_id and len(opened.nonce) == 32
    sent = b"".join(raw)
    assert TOKEN.encode() not in sent
    key = FleetKey(TOKEN)
    theirs = bytes.fromhex(captured["nonce"])
    assert key.client_proof(s.set_id, opened.nonce, theirs) not in sent
    assert key.server_proof(s.set_id, opened.nonce, theirs) not in sent


@pytest.mark.parametrize("claims", ["checksums", "own-strong", "genuine"])
def test_a_relay_offering_its_own_bytes_under_a_real_offer_is_refused(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, claims: str
) -> None:
    """The handshake is not bound to the connection: a rogue without the token at B's
    --peers address relays FillOpen and both proofs between B and the real daemon A, takes
    A's offer and offers B its copy with a zeroed row under A's manifest (the genuine XXH3
    checksums) and attestation, through its own NIXL agent. With no strong digests (the
    offer of a protocol that attested checksums alone) or its copy's own, B refuses the
    offer before reading a byte; with A's genuine strong and piece digests too (what bytes
    built to share the genuine XXH3 would claim), B reads the pieces and refuses the one
    with the row by its piece digest. B then loads from its files."""
    a = nodes("a")
    serving(a, checkpoint, net, token_file)
    relay = f"relay-{claims}"
    with rogue_peer(net, checkpoint, 7078, relay, f"{net.ip_a}:7077") as (rogue, started):
        b = nodes("b")
        rb = b.start(
            [
                *("--checkpoint", str(checkpoint), "--peers", f"{net.ip_a}:7078"),
                *("--peer-token-file", str(token_file)),
            ],
            net.b,
        )
        s = ready_set(rb)
        captured = rogue.ask("captured")
    assert s.source == "files", rb.log
    # The relay passed B's proof to A and got the real offer.
    assert "filling set" in a.daemon.log
    refused = f"set {s.set_id}: peer {net.ip_a}:7078: "
    if claims == "checksums":
        assert refused + "the peer's offer carries no strong digests" in rb.log
    elif claims == "own-strong":
        assert refused + "the peer's digests carry no valid attestation" in rb.log
    else:
        assert "piece" in captured["kinds"]  # B read the rogue's bytes
        first = plan_tables(checkpoint).tensors[0].name
        # The zeroed row lies in the first tensor: its piece is the row's.
        at = started["row"] // PIECE_BYTES * PIECE_BYTES
        piece = at // PIECE_BYTES
        lie = f"{refused}it sent piece {piece} (tensor {first!r}, bytes {at}..) with another digest"
        assert lie in rb.log, rb.log
    if claims != "genuine":
        assert "piece" not in captured["kinds"]
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


# -- one side without the token -----------------------------------------------------------


def test_a_server_with_another_token_is_refused(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    """A real daemon with another token cannot prove the fleet's: B sends no proof, loads
    from its files; A never offers."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, write_token(tmp_path / "other", OTHER_TOKEN))
    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == "files"
    assert f"peer {net.ip_a}:7077 could not prove it holds the fleet's token; refused" in rb.log
    assert "filling set" not in a.daemon.log


@pytest.mark.parametrize("holds_token", [True, False])
def test_a_receiver_must_prove_the_token_before_any_offer(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path, holds_token: bool
) -> None:
    """A receiver of its own making in namespace B that answers the server's proof with a
    proof under another token gets PERMISSION_DENIED and nothing else (no offer, no
    metadata); under the fleet's token it gets the offer with A's attestation."""
    a = nodes("a")
    ra = serving(a, checkpoint, net, token_file)
    s = ready_set(ra)
    probe_token = token_file if holds_token else write_token(tmp_path / "other", OTHER_TOKEN)
    probe = subprocess.run(
        [
            *Net.run_in(net.b),
            *(sys.executable, str(SUPPORT / "peer_probe.py")),
            *(f"{net.ip_a}:7077", s.set_id, str(probe_token)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    if holds_token:
        m = manifest_of(a.shm_dir, s.set_id)
        assert got["server_proven"] and got["offered"] and got["code"] == "OK", got
        assert m.attestation is None  # loaded from its files: signed when offered
        # The strong digests A took from its copy's pages are the files' own.
        assert got["strong"] == strong_of(checkpoint)
        assert FleetKey(TOKEN).attested(
            got["attestation"], m.set_id, m.fingerprint, m.tensors, got["strong"]
        )
        assert "strong digests of its" in ra.log
    else:
        assert not got["server_proven"] and not got["offered"], got
        assert got["code"] == "PERMISSION_DENIED", got
        assert "wrong peer token" in got["details"]
        assert "wrong token; refused" in ra.log and "filling set" not in ra.log


# -- the attestation travels with the set -------------------------------------------------


def test_a_filled_set_keeps_the_origin_attestation_for_the_next_hop(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """A loads from its files; B fills from A and keeps A's attestation and strong digests
    in its manifest; C (in A's namespace, asking only B) fills from B and verifies it.
    `engramd verify` passes on both filled nodes, and fails once B's kept attestation stops
    covering its digests, or its kept strong digests are not the attested ones (the same
    XXH3 checksums)."""
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    serving(a, checkpoint, net, token_file)
    rb = b.start(
        [
            *("--checkpoint", str(checkpoint), "--peers", f"{net.ip_a}:7077"),
            *("--peer-listen", f"{net.ip_b}:7077", "--peer-token-file", str(token_file)),
        ],
        net.b,
    )
    sb = ready_set(rb)
    assert sb.source == f"peer {net.ip_a}:7077", rb.log
    origin = manifest_of(a.shm_dir, sb.set_id)
    filled = manifest_of(b.shm_dir, sb.set_id)
    key = FleetKey(TOKEN)
    strong = strong_of(checkpoint)
    assert filled.strong_digests == tuple(strong)
    assert filled.attestation == key.attest(
        origin.set_id, origin.fingerprint, origin.tensors, strong
    )
    rc = c.start(
        [
            *("--checkpoint", str(checkpoint), "--peers", f"{net.ip_b}:7077"),
            *("--peer-token-file", str(token_file)),
        ],
        net.a,
    )
    sc = ready_set(rc)
    assert sc.source == f"peer {net.ip_b}:7077", rc.log
    assert "filling set" in rb.log
    hop = manifest_of(c.shm_dir, sc.set_id)
    assert (hop.attestation, hop.strong_digests) == (filled.attestation, filled.strong_digests)
    assert set_digests(c.shm_dir, sc.set_id) == checkpoint_digests(checkpoint)
    for d in (rb, rc):
        checked = engramd("verify", sb.set_id, "--socket", str(d.socket))
        assert checked.returncode == 0, checked.stderr
        assert "tensors match" in checked.stdout
    # A kept attestation that no longer covers the manifest's digests fails verify (B
    # restarted adopts the set with its manifest as found on tmpfs).
    path = sets_root(b.shm_dir) / sb.set_id / "manifest.json"
    genuine = json.loads(path.read_text())
    other = f"{STRONG}:" + "0" * 64
    for change in (
        {
            "attestation": key.attest(
                origin.set_id, origin.fingerprint, origin.tensors[:-1], strong[:-1]
            )
        },
        {"strong_digests": [other, *strong[1:]]},
    ):
        rb.stop()
        path.write_text(json.dumps({**genuine, **change}))
        rb = b.restart()
        assert ready_set(rb).source == "adopted"
        checked = engramd("verify", sb.set_id, "--socket", str(rb.socket))
        assert checked.returncode == 1, change
        assert "manifest.json: its digests are not the ones its origin attested" in checked.stdout


def test_a_set_an_older_engramd_filled_adopts_but_is_not_offered(
    net: Net, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """B's filled set as an engramd that attested checksums alone left it (an attestation,
    no strong digests): the upgraded B adopts it, but has no strong digests to forward and
    signs none of its own, so a receiver proving the token gets NOT_FOUND saying why, and
    `engramd verify` says the attestation cannot be checked."""
    a, b = nodes("a"), nodes("b")
    serving(a, checkpoint, net, token_file)
    rb = b.start(
        [
            *("--checkpoint", str(checkpoint), "--peers", f"{net.ip_a}:7077"),
            *("--peer-listen", f"{net.ip_b}:7077", "--peer-token-file", str(token_file)),
        ],
        net.b,
    )
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    rb.stop()
    path = sets_root(b.shm_dir) / s.set_id / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["strong_digests"]
    path.write_text(json.dumps(doc))
    rb = b.restart()
    assert ready_set(rb).source == "adopted"
    probe = subprocess.run(
        [
            *Net.run_in(net.a),
            *(sys.executable, str(SUPPORT / "peer_probe.py")),
            *(f"{net.ip_b}:7077", s.set_id, str(token_file)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["server_proven"] and not got["offered"] and got["code"] == "NOT_FOUND", got
    assert "filled by an older engramd that kept no strong digests" in got["details"]
    checked = engramd("verify", s.set_id, "--socket", str(rb.socket))
    assert checked.returncode == 1
    assert "an older engramd filled it and kept no strong digests" in checked.stdout


# -- the object store ---------------------------------------------------------------------


def _altered_copy(checkpoint: Path, into: Path) -> Path:
    """The checkpoint with one 256-byte row of its first table zeroed, away from the header
    and the samples the set id takes (so the set id and the object checks still match)."""
    shutil.copytree(checkpoint, into)
    entry = plan_tables(checkpoint).tensors[0]
    span = entry.spans[0]
    path = into / Path(span.file).name
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
    start = 8 + length
    room = max(size - start - SAMPLE_BYTES, 0)
    samples = [start + room * k // (SAMPLES - 1) for k in range(SAMPLES)]
    at = span.offset + (span.nbytes // 2) // 256 * 256
    while any(s - 256 < at < s + SAMPLE_BYTES for s in samples):
        at += 256
    assert span.offset <= at and at + 256 <= span.offset + span.nbytes
    with open(path, "r+b") as f:
        f.seek(at)
        assert f.read(256) != bytes(256)
        f.seek(at)
        f.write(bytes(256))
    return into


@pytest.mark.parametrize("manifest", ["none", "forged", "genuine"])
def test_an_object_with_one_altered_row_is_refused(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path, manifest: str
) -> None:
    """A bucket writer without the token replaced an object by one with a zeroed row: with
    no attested manifest, with one it made under another token, or beside the operator's
    genuine one, the fill is refused and the files fill the set."""
    evil = _altered_copy(checkpoint, tmp_path / "evil")
    s3.upload(evil, "m")
    if manifest == "forged":
        s3.attest(evil, "m", write_token(tmp_path / "other", OTHER_TOKEN))
    elif manifest == "genuine":
        s3.attest(checkpoint, "m", token_file)
    node = nodes("s")
    d = node.start(
        [
            *("--checkpoint", str(checkpoint), "--object-store", f"s3://{s3.bucket}/m"),
            *("--peer-token-file", str(token_file)),
        ],
        env=s3.env(),
    )
    s = ready_set(d)
    assert s.source == "files", d.log
    where = f"s3://{s3.bucket}/m/engramd-manifest-{s.set_id}.json"
    if manifest == "none":
        assert f"{where}: cannot read the set's attested manifest" in d.log
    elif manifest == "forged":
        assert f"{where} carries no valid attestation of the fleet's key" in d.log
    else:
        # The digest, or (rarely, when a random range hits the row) the spot check.
        assert "the bucket holds other bytes" in d.log or "other bytes than the checkpoint" in d.log
    assert "loading from the files" in d.log
    assert set_digests(node.shm_dir, s.set_id) == checkpoint_digests(checkpoint)


def test_an_object_store_fill_needs_the_token(s3: S3, nodes: Any, checkpoint: Path) -> None:
    """Without a token there is no key to check the bucket's manifest with: files, and why."""
    s3.upload(checkpoint, "m")
    node = nodes("s")
    d = node.start(
        ["--checkpoint", str(checkpoint), "--object-store", f"s3://{s3.bucket}/m"], env=s3.env()
    )
    s = ready_set(d)
    assert s.source == "files", d.log
    assert "an object-store fill needs --peer-token-file" in d.log


def _filled_from_bucket(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> tuple[Any, Any, Any]:
    """A node started with the bucket's prefix "m" and the token; (node, daemon, set) once
    its set is ready, which must have come from the bucket."""
    node = nodes("s")
    d = node.start(
        [
            *("--checkpoint", str(checkpoint), "--object-store", f"s3://{s3.bucket}/m"),
            *("--peer-token-file", str(token_file)),
        ],
        env=s3.env(),
    )
    s = ready_set(d)
    assert s.source == f"s3://{s3.bucket}/m", d.log
    return node, d, s


def test_a_filled_object_store_set_carries_the_attestation(
    s3: S3, nodes: Any, checkpoint: Path, token_file: Path
) -> None:
    """The genuine manifest: the set comes from the bucket, its manifest keeps the bucket's
    attestation, and `engramd verify` passes."""
    s3.upload(checkpoint, "m")
    s3.attest(checkpoint, "m", token_file)
    node, d, s = _filled_from_bucket(s3, nodes, checkpoint, token_file)
    m = manifest_of(node.shm_dir, s.set_id)
    assert m.attestation is not None and m.strong_digests == tuple(strong_of(checkpoint))
    assert FleetKey(TOKEN).attested(
        m.attestation, m.set_id, m.fingerprint, m.tensors, m.strong_digests
    )
    checked = engramd("verify", s.set_id, "--socket", str(d.socket))
    assert checked.returncode == 0, checked.stderr


# -- the token file -----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "folder_mode"), [(0o644, 0o700), (0o640, 0o700), (0o400, 0o777)])
def test_a_token_file_others_may_read_or_replace_stops_the_daemon(
    nodes: Any, tmp_path: Path, mode: int, folder_mode: int
) -> None:
    """As ssh refuses a private key: group- or world-readable, or in a folder others may
    write; the message names the file, its mode and the fix."""
    folder = tmp_path / "secret"
    folder.mkdir()
    token = write_token(folder / "token", TOKEN)
    token.chmod(mode)
    folder.chmod(folder_mode)
    node = nodes("x")
    with pytest.raises(RuntimeError, match="exited with"):
        node.start(["--peer-listen", "127.0.0.1:0", "--peer-token-file", str(token)])
    log = node.daemon.log
    if folder_mode == 0o700:
        assert f"{token} has mode {mode:04o}" in log and f"`chmod 0400 {token}`" in log
    else:
        assert f"the folder {folder} has mode 0777" in log and f"`chmod go-w {folder}`" in log
