"""The on-tmpfs layout of table sets, shared by the daemon and its workers.

::

    <shm_dir>/engramd/                       0750, owned by the daemon
        <set_id>/                            a complete set; appears by rename
            manifest.json                    written last, 0640 (a disk's: 0440)
            0000.bin  0001.bin  ...          one file per tensor, 0640 (0440), the
                                             tensor's bytes at its lead (its offset
                                             in the checkpoint modulo DIRECT_ALIGN;
                                             on a disk 0), lead + `nbytes` long
                                             (every page allocated)
        <set_id>/                            a packed set (hugetlbfs: no write(),
            tables                           huge pages): every tensor in one file,
                                             each at its lead past a 4 KiB boundary,
                                             the manifest and its trailer at the end
                                             of the last huge page (TRAILER), no
                                             manifest.json
        <set_id>-node<N>/                    a copy kept for NUMA node N
                                             (--numa per-node): same layout
        <set_id>.loading-<pid>-<hex>/        a load in progress: never attached
                                             to, removed by the next daemon
        .lock                                0600, flock'd by the daemon that
                                             serves the folder, for its life

manifest.json::

    {"layout_version": 1, "set_id": "...", "fingerprint": "<sha256>",
     "nonce": "<32 hex, random per load>", "checkpoint": "/abs/path",
     "selection": "*engram.embed.*", "created": <unix time>,
     "sources": [{"path": "/real/path/model-00001.safetensors", "dev": ..., "ino": ...,
                  "size": ..., "mtime_ns": ..., "ctime_ns": ...}, ...],
     "tensors": [{"name": "layers.1.engram.embed.weight", "dtype": "F8_E4M3",
                  "shape": [rows, 256], "file": "0000.bin", "offset": <lead>,
                  "nbytes": ..., "checksum": "xxh3-64-pieces:<16 hex>"}, ...],
     "node": N,                              only in a copy kept for node N
     "attestation": "hmac-sha256:<hex>",     only in a set filled from a peer or an
                                             object store: the origin's attestation
                                             of the digests (engramd/fleet/trust.py)
     "strong_digests": ["blake3-pieces:<hex>", ...]}
                                             beside it: each tensor's strong digest
                                             the origin attested, in order
                                             (engramd/strong.py)

A set folder never changes after its rename: the daemon writes everything
under the `.loading-*` name, writes the manifest last and renames; on a
disk (engramd/backings/disk.py) each step is fsynced before the next, on a
tmpfs nothing is. A crash at any point leaves either no set folder or a
complete one. The nonce lets a worker prove that the file it opened is the one the
daemon described: a worker in another mount or IPC namespace sees another
/dev/shm, where the manifest is missing or carries another nonce.

Nothing here is trusted by its name alone: the daemon (adopting) and the
worker (mapping) open every folder and file without following symlinks and
accept it only when the daemon's user owns it and nobody else may write it.
A folder another user made first (in /dev/shm anyone can) is never used.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from engramd_shared.checkpoint import LAYOUT_VERSION, is_set_id
from engramd_shared.fileid import SourceFile
from engramd_shared.headers import DTYPES

#: Folder inside the shm folder that holds every set.
ROOT_NAME = "engramd"
MANIFEST_NAME = "manifest.json"
LOADING_MARK = ".loading-"
#: The file a daemon holds an exclusive flock on while it serves the folder: one per folder.
LOCK_NAME = ".lock"
#: The one file of a packed set, and its last bytes: magic, manifest length.
PACKED_NAME = "tables"
TRAILER = struct.Struct("<8sQ")
TRAILER_MAGIC = b"engramd\x01"
#: Alignment of the places of tensors in a packed file (a page of the smallest size).
PACKED_ALIGN = 4096
#: In a set whose pages the loader maps, a tensor starts at its checkpoint offset modulo
#: this (a page: every block device's logical block divides it), its lead, so that a
#: direct read of the checkpoint lands in the set's own pages (engramd/sets/loader.py).
DIRECT_ALIGN = 4096

_NONCE = re.compile(r"^[0-9a-f]{32}$")
_COPY = re.compile(r"^[0-9a-f]{20}(-node\d+)?$")


class ManifestError(ValueError):
    """A manifest that does not describe a complete set."""


class NotOwned(ManifestError):
    """A folder or file of the layout that is not the daemon's alone."""


def _check_owner(path: Path, st: os.stat_result, owner: int) -> None:
    if st.st_uid != owner:
        raise NotOwned(f"{path} is owned by uid {st.st_uid}, not engramd's uid {owner}")
    if st.st_mode & 0o022:
        raise NotOwned(f"{path} may be written by others (mode {stat.S_IMODE(st.st_mode):04o})")


def check_owned_dir(path: Path, owner: int) -> None:
    """Raise NotOwned unless `path` is a real folder (no symlink) that only `owner` may change."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotOwned(f"{path} is not a folder (a symlink or a file)")
    _check_owner(path, st, owner)


def open_owned(path: Path, owner: int) -> int:
    """A read-only descriptor of `path`: a regular file, no symlink, only `owner` may write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotOwned(f"{path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOwned(f"{path} is not a regular file")
        _check_owner(path, st, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class ManifestTensor:
    """Where one tensor of a set lies in the set's folder."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    checksum: str
    #: The checkpoint tensors it is made of where that is not itself alone (a table joined
    #: from row shards: its shards, in order); () in sets of engramd before it was kept.
    parts: tuple[str, ...] = ()
    #: Beside `parts`: the rows of each, in order; () in sets of engramd before it was kept.
    part_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """What a complete set folder holds."""

    set_id: str
    fingerprint: str
    nonce: str
    checkpoint: str
    selection: str
    created: float
    tensors: tuple[ManifestTensor, ...]
    #: The checkpoint files as they were when loaded (none in sets of engramd 0.1.0).
    sources: tuple[SourceFile, ...] = ()
    layout_version: int = LAYOUT_VERSION
    #: The NUMA node this copy is kept for (--numa per-node); None: the set's one copy.
    node: int | None = None
    #: A filled set's digests as the node that loaded it from its files attested them (the
    #: fleet's key); None: this node's own digests, taken from its files.
    attestation: str | None = None
    #: Beside `attestation`: each tensor's strong digest (SHA-256 over its pieces) as the
    #: origin attested it, in order; None in a set loaded from files, or filled by an engramd
    #: that attested checksums alone.
    strong_digests: tuple[str, ...] | None = None

    @property
    def copy(self) -> str:
        """The name of this copy of the set in its backing (copy_name)."""
        return copy_name(self.set_id, self.node)

    @property
    def nbytes(self) -> int:
        """The tensors' bytes, without padding."""
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> str:
        """Serialize for manifest.json ("node" only in a copy kept per NUMA node,
        "attestation" and "strong_digests" only in a filled set)."""
        doc = asdict(self)
        for optional in ("node", "attestation", "strong_digests"):
            if doc[optional] is None:
                del doc[optional]
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse manifest.json; raises ManifestError on anything malformed."""
        try:
            doc = json.loads(text)
            if doc["layout_version"] != LAYOUT_VERSION:
                raise ManifestError(
                    f"layout version {doc['layout_version']}, this engramd reads {LAYOUT_VERSION}"
                )
            tensors = tuple(
                ManifestTensor(
                    name=str(t["name"]),
                    dtype=str(t["dtype"]),
                    shape=tuple(int(d) for d in t["shape"]),
                    file=str(t["file"]),
                    offset=int(t["offset"]),
                    nbytes=int(t["nbytes"]),
                    checksum=str(t["checksum"]),
                    parts=tuple(str(p) for p in t.get("parts", ())),
                    part_rows=_part_rows(t.get("part_rows", [])),
                )
                for t in doc["tensors"]
            )
            sources = tuple(
                SourceFile(
                    path=str(f["path"]),
                    **{k: int(f[k]) for k in ("dev", "ino", "size", "mtime_ns", "ctime_ns")},
                )
                for f in doc.get("sources", ())
            )
            manifest = cls(
                set_id=str(doc["set_id"]),
                fingerprint=str(doc["fingerprint"]),
                nonce=str(doc["nonce"]),
                checkpoint=str(doc["checkpoint"]),
                selection=str(doc["selection"]),
                created=float(doc["created"]),
                tensors=tensors,
                sources=sources,
                node=None if doc.get("node") is None else int(doc["node"]),
                attestation=_optional_str(doc.get("attestation")),
                strong_digests=_optional_strs(doc.get("strong_digests"), len(tensors)),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"malformed manifest ({e!r})") from None
        if not is_set_id(manifest.set_id) or not _NONCE.match(manifest.nonce):
            raise ManifestError("malformed set id or nonce")
        for t in manifest.tensors:
            if t.dtype not in DTYPES or Path(t.file).name != t.file or t.offset < 0:
                raise ManifestError(f"malformed entry for tensor {t.name!r}")
            if t.part_rows and (
                len(t.part_rows) != len(t.parts)
                or not t.shape
                or min(t.part_rows) < 1
                or sum(t.part_rows) != t.shape[0]
            ):
                raise ManifestError(f"the row shards of tensor {t.name!r} do not add up")
        return manifest


def _part_rows(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(n) is not int for n in value):
        raise ManifestError("part_rows is not a list of whole numbers")
    return tuple(value)


def _optional_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ManifestError(f"malformed attestation {value!r}")


def _optional_strs(value: object, count: int) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, list) and len(value) == count and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ManifestError(f"malformed strong digests (not {count} strings, one a tensor)")


def sets_root(shm_dir: str | os.PathLike[str]) -> Path:
    """The folder that holds every set in a shm folder."""
    return Path(shm_dir) / ROOT_NAME


def copy_name(set_id: str, node: int | None) -> str:
    """The name of a copy of a set: its id, and `-node<N>` for a copy kept for NUMA node N."""
    return set_id if node is None else f"{set_id}-node{node}"


def is_copy_name(name: str) -> bool:
    """True for names copy_name makes."""
    return _COPY.match(name) is not None


def set_dir(shm_dir: str | os.PathLike[str], copy: str) -> Path:
    """The folder of a complete copy of a set (named by copy_name)."""
    return sets_root(shm_dir) / copy


def tensor_file_name(index: int) -> str:
    """The file name of the index-th tensor of a set."""
    return f"{index:04d}.bin"


def read_manifest(folder: Path, owner: int) -> Manifest:
    """Read and parse the manifest of a set folder that `owner` (a uid) owns, as its manifest.

    manifest.json, or for a packed set the manifest at the end of its one file.
    """
    check_owned_dir(folder.parent, owner)
    check_owned_dir(folder, owner)
    try:
        fd = open_owned(folder / MANIFEST_NAME, owner)
    except FileNotFoundError:
        with open(open_owned(folder / PACKED_NAME, owner), "rb") as f:
            return Manifest.from_json(read_trailer(f.fileno()))
    with open(fd, "rb") as f:
        return Manifest.from_json(f.read())


class Placed(Protocol):
    """A tensor's bytes somewhere: a checkpoint's (TensorEntry) or a set's (ManifestTensor)."""

    @property
    def dtype(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def lead(t: Placed) -> int:
    """Bytes before a tensor in its place in a set: its offset (in its checkpoint, or in a
    set) within a DIRECT_ALIGN page, unless that would leave its elements unaligned (a
    checkpoint that puts a tensor off its element size: then 0, and it is read buffered)."""
    within = t.offset % DIRECT_ALIGN
    return within if within % DTYPES.get(t.dtype, (1, ""))[0] == 0 else 0


def extents(tensors: Iterable[Placed]) -> list[int]:
    """The bytes each tensor's place takes in a set: its lead, then its own bytes."""
    return [lead(t) + t.nbytes for t in tensors]


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(offset of each place, end of the last) in a packed file: PACKED_ALIGN-aligned, in order."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // PACKED_ALIGN) * PACKED_ALIGN
    return offsets, end


def packed_tensors(tensors: Sequence[Placed]) -> tuple[list[int], int]:
    """(offset of each tensor, end of the last place) in a packed file: each tensor at its
    lead in its place."""
    places, end = packed_offsets(extents(tensors))
    return [at + lead(t) for at, t in zip(places, tensors, strict=True)], end


def trailer(manifest: bytes) -> bytes:
    """The manifest and the trailer that ends a packed file."""
    return manifest + TRAILER.pack(TRAILER_MAGIC, len(manifest))


def read_trailer(fd: int) -> bytes:
    """The manifest bytes at the end of a packed file; raises ManifestError if there is none."""
    size = os.fstat(fd).st_size
    if size < TRAILER.size:
        raise ManifestError("the packed file is too short for its trailer")
    magic, length = TRAILER.unpack(os.pread(fd, TRAILER.size, size - TRAILER.size))
    if magic != TRAILER_MAGIC or length > size - TRAILER.size:
        raise ManifestError("the packed file has no manifest (an interrupted load?)")
    return os.pread(fd, length, size - TRAILER.size - length)


def check_complete(folder: Path, manifest: Manifest, owner: int) -> None:
    """Raise ManifestError unless every tensor file is there, `owner`'s, at its full size."""
    if manifest.copy != folder.name:
        raise ManifestError(f"manifest names copy {manifest.copy}, folder is {folder.name}")
    for t in manifest.tensors:
        try:
            fd = open_owned(folder / t.file, owner)
        except OSError as e:
            raise ManifestError(f"tensor {t.name!r}: {t.file}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < t.offset + t.nbytes:
            raise ManifestError(
                f"tensor {t.name!r}: {t.file} is {size} bytes, manifest says at least "
                f"{t.offset + t.nbytes}"
            )
