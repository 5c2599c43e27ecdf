"""What the fleet's token proves: the peers to each other, and a set's digests to a receiver.

Nothing here sends the token. Three keys are derived from it (HKDF-SHA256,
one label each), so that no value made under one can stand for another:

- "server proof": the serving daemon answers a receiver's FillOpen (the set
  id and the receiver's nonce) with a nonce of its own and
  HMAC(server key, set id, receiver's nonce, its nonce). A server without
  the token cannot make it, and the receiver says nothing more to it.
- "client proof": only then does the receiver send HMAC(client key, set id,
  both nonces); the server offers the set only for a valid one. Both nonces
  are new for every fill, so a proof seen once opens nothing later.
- "manifest": a node that loaded a set from its own files attests its
  digests: HMAC(manifest key, the set id, its fingerprint and each tensor's
  name, dtype, shape, size, XXH3-64 checksum and strong digest, BLAKE3
  over its pieces: strong.py). A receiver checks the attestation before it
  reads a byte and publishes only bytes whose digests, both kinds, are the
  attested ones (`check_received`); a node that filled a set keeps the
  origin's attestation and strong digests in its manifest and forwards
  them, never signs one of its own. The object store's copy of a
  checkpoint carries one beside it (`manifest_key`), made by `engramd
  manifest`. XXH3 alone would not do: it is no defence against bytes built
  to share a tensor's XXH3, and an offer is not bound to the handshake (a
  relay can pass the proofs along and offer its own bytes under the real
  attestation).

Every comparison of a proof or an attestation is constant-time
(hmac.compare_digest). The token file is refused unless only its owner may
read it, in folders only their owners may write (`read_token`), as ssh
treats a private key.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engramd.fleet.base import SourceFailed
from engramd.sets.seams import Attestable
from engramd.strong import digest_files, is_strong
from engramd_shared.checkpoint import TablePlan

#: Random bytes each side adds to a fill's handshake.
NONCE_BYTES = 32
#: How an attestation is written: the MAC's name, then its hex digest.
ATTESTATION = "hmac-sha256"
#: The object store's attested manifest: its first bytes (a fixed-size read), the JSON after.
OBJECT_MAGIC = b"engramd-manifest-v2 "
#: The header: the magic, the JSON's length in 11 digits, a newline.
OBJECT_HEADER_BYTES = len(OBJECT_MAGIC) + 12
#: Most bytes of a manifest object's JSON (a manifest is ~200 bytes a tensor).
OBJECT_MAX_BYTES = 16 << 20
#: The token's least length.
TOKEN_MIN_CHARS = 16

_SALT = b"engramd fleet token v1"


def _framed(*parts: bytes | str) -> bytes:
    """Each part after its length: no two sequences of parts give the same bytes."""
    out = bytearray()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        out += len(data).to_bytes(8, "big") + data
    return bytes(out)


class FleetKey:
    """The keys derived from the fleet's token; the token itself is not kept."""

    def __init__(self, token: str) -> None:
        # HKDF (RFC 5869): extract with a fixed salt, one expanded block per label.
        prk = hmac.digest(_SALT, token.encode(), "sha256")
        self._keys = {
            label: hmac.digest(prk, label + b"\x01", "sha256")
            for label in (b"server proof", b"client proof", b"manifest")
        }

    def _mac(self, label: bytes, *parts: bytes | str) -> bytes:
        return hmac.digest(self._keys[label], _framed(label, *parts), "sha256")

    def server_proof(self, set_id: str, theirs: bytes, mine: bytes) -> bytes:
        """The server's proof for a fill of `set_id`: the receiver's nonce, then its own."""
        return self._mac(b"server proof", set_id, theirs, mine)

    def client_proof(self, set_id: str, mine: bytes, theirs: bytes) -> bytes:
        """The receiver's proof: its own nonce, then the server's."""
        return self._mac(b"client proof", set_id, mine, theirs)

    def attest(
        self,
        set_id: str,
        fingerprint: str,
        tensors: Sequence[Attestable],
        strong: Sequence[str],
    ) -> str:
        """The attestation ("hmac-sha256:<hex>") of a set's tensors with their checksums and
        `strong`, each tensor's strong digest in order."""
        if len(strong) != len(tensors):
            raise ValueError(f"{len(strong)} strong digests for {len(tensors)} tensors")
        # "v2": an attestation of checksums alone (v1) never stands for one of both.
        parts: list[bytes | str] = ["v2", set_id, fingerprint, str(len(tensors))]
        for t, digest in zip(tensors, strong, strict=True):
            shape = ",".join(str(d) for d in t.shape)
            parts += [t.name, t.dtype, shape, str(t.nbytes), t.checksum, digest]
        return f"{ATTESTATION}:{self._mac(b'manifest', *parts).hex()}"

    def attested(
        self,
        attestation: str,
        set_id: str,
        fingerprint: str,
        tensors: Sequence[Attestable],
        strong: Sequence[str],
    ) -> bool:
        """Whether `attestation` is this fleet's of exactly these tensors, checksums and strong
        digests (constant-time); False for strong digests of another count or form."""
        if len(strong) != len(tensors) or not all(is_strong(d) for d in strong):
            return False
        return hmac.compare_digest(
            attestation.encode(), self.attest(set_id, fingerprint, tensors, strong).encode()
        )


def nonce() -> bytes:
    """A fresh nonce for one side of a handshake."""
    return secrets.token_bytes(NONCE_BYTES)


def proven(proof: bytes, expected: bytes) -> bool:
    """A proof compared in constant time."""
    return hmac.compare_digest(proof, expected)


def check_received(
    names: Sequence[str], strong: Sequence[str], got: Sequence[str], culprit: str
) -> None:
    """Raise SourceFailed naming the first tensor whose received bytes do not have the
    attested strong digest (`got`: theirs). Every byte is covered, so the attested XXH3
    checksums are then the received bytes' too. `culprit` ends the message."""
    for name, want, mine in zip(names, strong, got, strict=True):
        if mine != want:
            raise SourceFailed(
                f"tensor {name!r} arrived with strong digest {mine}, the attested one is "
                f"{want}: {culprit}"
            )


# -- the object store's attested manifest ---------------------------------------------------


def manifest_key(prefix: str, set_id: str) -> str:
    """The key of a set's attested manifest in the bucket, beside the checkpoint's files."""
    name = f"engramd-manifest-{set_id}.json"
    return f"{prefix}/{name}" if prefix else name


@dataclass(frozen=True)
class AttestedTensor:
    """One tensor as an attested manifest names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    #: The strong digest (strong.py).
    strong: str


@dataclass(frozen=True)
class AttestedManifest:
    """A set's digests and their attestation, as kept beside a checkpoint in a bucket."""

    set_id: str
    fingerprint: str
    tensors: tuple[AttestedTensor, ...]
    attestation: str

    def to_bytes(self) -> bytes:
        """The object: a fixed-size header with the JSON's length, then the JSON."""
        body = json.dumps(
            {
                "set_id": self.set_id,
                "fingerprint": self.fingerprint,
                "tensors": [
                    {
                        "name": t.name,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "nbytes": t.nbytes,
                        "checksum": t.checksum,
                        "strong": t.strong,
                    }
                    for t in self.tensors
                ],
                "attestation": self.attestation,
            },
            indent=1,
        ).encode()
        return OBJECT_MAGIC + f"{len(body):011d}\n".encode() + body

    @staticmethod
    def body_length(header: bytes) -> int:
        """The JSON's length from the object's first OBJECT_HEADER_BYTES; ValueError if none."""
        digits = header[len(OBJECT_MAGIC) : -1]
        if (
            len(header) != OBJECT_HEADER_BYTES
            or not header.startswith(OBJECT_MAGIC)
            or header[-1:] != b"\n"
            or not digits.isdigit()
        ):
            raise ValueError("it is not an engramd manifest (its first bytes)")
        n = int(digits)
        if not 0 < n <= OBJECT_MAX_BYTES:
            raise ValueError(f"it names a manifest of {n} bytes")
        return n

    @classmethod
    def from_body(cls, body: bytes) -> AttestedManifest:
        """Parse the JSON; ValueError (or KeyError, TypeError) on anything malformed."""
        doc = json.loads(body)
        return cls(
            set_id=str(doc["set_id"]),
            fingerprint=str(doc["fingerprint"]),
            tensors=tuple(
                AttestedTensor(
                    name=str(t["name"]),
                    dtype=str(t["dtype"]),
                    shape=tuple(int(d) for d in t["shape"]),
                    nbytes=int(t["nbytes"]),
                    checksum=str(t["checksum"]),
                    strong=str(t["strong"]),
                )
                for t in doc["tensors"]
            ),
            attestation=str(doc["attestation"]),
        )


def attest_checkpoint(plan: TablePlan, key: FleetKey) -> AttestedManifest:
    """Digest every tensor of `plan` from its files (a load's read: both digests in one pass)
    and attest the digests. Raises ValueError for a file shorter than its header says."""
    tensors = []
    for t in plan.tensors:
        checksum, strong = digest_files([(span.file, span.offset, span.nbytes) for span in t.spans])
        tensors.append(AttestedTensor(t.name, t.dtype, tuple(t.shape), t.nbytes, checksum, strong))
    return AttestedManifest(
        set_id=plan.set_id,
        fingerprint=plan.fingerprint,
        tensors=tuple(tensors),
        attestation=key.attest(plan.set_id, plan.fingerprint, tensors, [t.strong for t in tensors]),
    )


# -- the token file -------------------------------------------------------------------------


def read_token(path: str) -> str:
    """The fleet's token from its file; refuses one others may read or replace.

    As ssh treats a private key: the file must be a regular file of the
    daemon's user (or root) that neither its group nor others may read or
    write, and every folder above it (after symlinks: a Kubernetes Secret's
    `..data` links) must belong to root or the daemon's user and be writable
    by no one else, unless it is sticky (/tmp), where others cannot replace
    what is not theirs.
    """
    if not path:
        raise ValueError(
            "--peer-listen and --peers need --peer-token-file: a file holding the fleet's "
            "shared token (a Kubernetes Secret)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"--peer-token-file {path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        real = Path(os.path.realpath(path))
        _check_token_file(path, real, st)
        data = f.read(4096)
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"--peer-token-file {path} is not text") from None
    if len(token) < TOKEN_MIN_CHARS:
        raise ValueError(
            f"--peer-token-file {path} holds {len(token)} characters; use at least "
            f"{TOKEN_MIN_CHARS} (e.g. `openssl rand -hex 32`)"
        )
    return token


def _check_token_file(path: str, real: Path, st: os.stat_result) -> None:
    me = os.geteuid()
    named = path if str(real) == path else f"{path} (the file {real})"
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"--peer-token-file {named} is not a regular file")
    if st.st_uid not in (me, 0):
        raise ValueError(
            f"--peer-token-file {named} is owned by uid {st.st_uid}; the token must belong to "
            f"the daemon's user (uid {me}) or root: `chown {me} {real}`"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(
            f"--peer-token-file {named} has mode {mode:04o}: its group or others may read it, "
            f"and whoever reads it can join the fleet; `chmod 0400 {real}`"
        )
    try:
        now = os.stat(real)
    except OSError as e:
        raise ValueError(f"--peer-token-file {named}: {e.strerror}") from None
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise ValueError(f"--peer-token-file {named} was replaced while it was read")
    for folder in real.parents:
        fst = os.stat(folder)
        fmode = stat.S_IMODE(fst.st_mode)
        if fst.st_uid not in (me, 0):
            raise ValueError(
                f"--peer-token-file {named}: the folder {folder} is owned by uid {fst.st_uid}, "
                f"who could replace the token; keep it in folders of root or the daemon's user "
                f"(uid {me})"
            )
        if fmode & 0o022 and not fmode & stat.S_ISVTX:
            raise ValueError(
                f"--peer-token-file {named}: the folder {folder} has mode {fmode:04o}: its "
                f"group or others may replace the token; `chmod go-w {folder}`, or keep the "
                "token in a folder only its owner may write"
            )
