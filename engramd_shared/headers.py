"""Read and validate the header of one safetensors file.

Only headers are read here (a few KiB per file), so a worker can compute the
set id of its own copy in milliseconds and the daemon can validate a request
before it copies a byte. Every header is checked against its file: a bad
header raises `CheckpointError` naming the file, the tensor and the fix.

safetensors format: an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}),
then the data; offsets count from the end of the header.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engramd_shared.errors import CheckpointError
from engramd_shared.fileid import SourceFile, open_regular

if TYPE_CHECKING:
    from engramd_shared.beneath import Opened

#: Data samples per file that go into the fingerprint, and their size.
SAMPLES = 8
SAMPLE_BYTES = 4096

# The reference implementation refuses headers above 100 MB; so do we, before
# allocating anything for a header length read from an untrusted file.
MAX_HEADER_BYTES = 100_000_000

#: Parsed headers kept per file identity, at most this many header bytes in all
#: (an entry, its text included, costs about 5x its header: ~320 MiB at the bound). A
#: header larger than the bound is parsed every time and never kept.
HEADER_CACHE_BYTES = 64 << 20

# Integers in a header are offsets and dimensions: 20 digits hold any uint64.
# Longer ones are refused before Python converts them (quadratic in digits).
_MAX_INT_DIGITS = 20

#: safetensors dtype name -> (bytes per element, torch dtype name). Torch itself is
#: imported only on the worker side (tables.py): the daemon never needs it.
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes are in which file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: The file's real path: symlinks resolved, so checks and reads see the same file.
    file: Path
    #: Absolute byte offset of the tensor's data in `file`.
    offset: int
    nbytes: int
    #: A table joined from row shards (checkpoint.py): the shards, in row order;
    #: `file` and `offset` are then the first shard's.
    parts: tuple[TensorEntry, ...] = ()

    @property
    def spans(self) -> tuple[TensorEntry, ...]:
        """The checkpoint tensors whose bytes, back to back, are this tensor's."""
        return self.parts or (self,)


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed and validated safetensors header."""

    #: The path as the checkpoint names it (its name goes into the fingerprint).
    path: Path
    size: int
    header: bytes
    tensors: dict[str, TensorEntry]
    #: sha256 of a few small samples of the data (see SAMPLES).
    samples: str
    #: The file read, with its identity when it was read.
    source: SourceFile


#: Given the file's stat and its header's length, a context the header is read and parsed
#: in (the daemon's cap on large headers read at once); it may refuse by raising.
Admit = Callable[[os.stat_result, int], AbstractContextManager[object]]


def read_header(
    path: Path,
    opened: Opened | None = None,
    max_header: int = MAX_HEADER_BYTES,
    admit: Admit | None = None,
) -> SafetensorsFile:
    """Parse and validate the header of one safetensors file.

    Any malformed header raises `CheckpointError` naming the file and the
    problem. Parsed headers are kept per file identity (HEADER_CACHE_BYTES);
    the data samples are read again on every call. `opened`: the file as a
    walk beneath a root found it (beneath.py), read from its descriptor.
    A header longer than `max_header` is refused before it is read.
    """
    if opened is not None:
        return _read_header(path, opened.path, opened.fd, max_header, admit)
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # missing, or a symlink loop
        raise CheckpointError(f"{path}: cannot resolve: {e}") from None
    fd = open_regular(real)
    try:
        return _read_header(path, real, fd, max_header, admit)
    finally:
        os.close(fd)


def _read_header(
    path: Path, real: Path, fd: int, max_header: int, admit: Admit | None
) -> SafetensorsFile:
    try:
        st = os.fstat(fd)
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: {size} bytes is too short for a safetensors file "
                "(truncated download or copy?); fetch the file again"
            )
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(
                f"{path}: header length {length} runs past the file's {size} bytes "
                "(truncated or not a safetensors file); fetch the file again"
            )
        if length > max_header:
            raise CheckpointError(
                f"{path}: its header of {length} bytes is longer than the {max_header} engramd "
                "reads for a worker's attach; have the operator load the checkpoint "
                "(engramd load, --checkpoint)"
            )
        with admit(st, length) if admit is not None else contextlib.nullcontext():
            header = _pread_all(fd, length, 8)
            if len(header) < length:
                raise CheckpointError(f"{path}: the file ended inside its header (truncated)")
            samples = _sample(fd, 8 + length, size)
            source = SourceFile.of(real, st)
            tensors = _HEADERS.parsed(source, header, lambda: _parse(path, real, header, size))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from e
    return SafetensorsFile(
        path=path,
        size=size,
        header=header,
        tensors=tensors,
        samples=samples,
        source=source,
    )


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    # One pread returns at most about 2 GiB; a header is at most MAX_HEADER_BYTES.
    parts = []
    while n:
        part = os.pread(fd, n, offset)
        if not part:
            break
        parts.append(part)
        n -= len(part)
        offset += len(part)
    return b"".join(parts)


class _HeaderCache:
    """Parsed headers by file identity, bounded by their header bytes; one parse at a time.

    A hit needs the identity and the header's bytes to be equal: a header
    rewritten in place where the filesystem keeps mtime and ctime (tmpfs,
    through a shared mapping) is parsed again. One parse at a time bounds
    the memory of many requests for one huge header to one parse (about 10x
    the header), and the later requests find it parsed.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._entries: OrderedDict[_Identity, tuple[bytes, dict[str, TensorEntry]]] = OrderedDict()
        self._lock = threading.Lock()
        self._parsing = threading.Lock()

    def _kept(self, source: SourceFile, header: bytes) -> dict[str, TensorEntry] | None:
        key = _identity(source)
        with self._lock:
            hit = self._entries.get(key)
            if hit is None or hit[0] != header:
                return None
            self._entries.move_to_end(key)
            tensors = hit[1]
        # Kept by the file, not its name: a hard link of it is not parsed again,
        # and its entries name the path it was read through this time.
        real = Path(source.path)
        if all(t.file == real for t in tensors.values()):
            return tensors
        return {name: dataclasses.replace(t, file=real) for name, t in tensors.items()}

    def parsed(
        self, source: SourceFile, header: bytes, parse: Callable[[], dict[str, TensorEntry]]
    ) -> dict[str, TensorEntry]:
        """The tensors of `header` read from `source`: kept, or parsed now by `parse`."""
        hit = self._kept(source, header)
        if hit is not None:
            return hit
        # One parse at a time (a huge header costs ~10x its size at its peak);
        # hits never wait behind it.
        with self._parsing:
            hit = self._kept(source, header)
            if hit is not None:
                return hit
            tensors = parse()
        if len(header) <= self._limit:
            with self._lock:
                old = self._entries.pop(_identity(source), None)
                self._held -= len(old[0]) if old else 0
                self._entries[_identity(source)] = (header, tensors)
                self._held += len(header)
                while self._held > self._limit:
                    _, (dropped, _) = self._entries.popitem(last=False)
                    self._held -= len(dropped)
        return tensors


#: A file as the header cache knows it: device, inode, size, mtime, ctime (no name).
_Identity = tuple[int, int, int, int, int]


def _identity(source: SourceFile) -> _Identity:
    return (source.dev, source.ino, source.size, source.mtime_ns, source.ctime_ns)


_HEADERS = _HeaderCache(HEADER_CACHE_BYTES)


def _parse(path: Path, real: Path, header: bytes, size: int) -> dict[str, TensorEntry]:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: malformed safetensors header ({problem}); fetch the file again"
        )

    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 at byte {e.start}") from None
    try:
        doc = json.loads(
            text,
            parse_int=bounded_int,
            parse_constant=_refuse_constant,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise bad("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and the hooks' refusals
        raise bad(str(e)) from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    metadata = doc.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not an object of strings")
    data_start = 8 + len(header)
    data_size = size - data_start
    tensors = {
        name: _entry(real, name, info, data_start, data_size)
        for name, info in doc.items()
        if name != "__metadata__"
    }
    _check_disjoint(real, tensors.values())
    return tensors


def bounded_int(text: str) -> int:
    """A JSON integer (json's parse_int hook), refused past 20 digits before it is converted."""
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {_MAX_INT_DIGITS})")
    return int(text)


def _refuse_constant(text: str) -> object:
    raise ValueError(f"{text} is not a number in a header")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # Two entries of one name: readers would disagree on which one is the tensor.
    doc: dict[str, object] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"key {key[:200]!r} appears twice")
        doc[key] = value
    return doc


def _check_disjoint(path: Path, tensors: Iterable[TensorEntry]) -> None:
    # Overlapping tensors would alias bytes that two names claim as their own.
    previous: TensorEntry | None = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise CheckpointError(
                f"{path}: tensors {previous.name!r} and {t.name!r} overlap (data_offsets); "
                "fetch the file again"
            )
        previous = t


def _sample(fd: int, start: int, end: int) -> str:
    # A file rewritten in place with new values but the same header and size
    # (a re-export, a fine-tune) must not keep the old set id. Hashing every
    # byte would take minutes per attach at 189 GiB; SAMPLES small reads
    # spread over the data catch any rewrite of more than a sliver of it.
    # Exactly the samples' pages and no readahead around them (the descriptor is the
    # plan's own: loads and proofs read through descriptors of their own).
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return samples_digest(os.pread(fd, n, at) for at, n in sample_ranges(start, end))


def sample_ranges(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the fingerprint's data samples of a file whose data runs from
    `start` to its end at `end`: SAMPLES of SAMPLE_BYTES spread over the data, the last
    ending at the file's end (fewer bytes, or none, where the data is shorter)."""
    span = max(end - start - SAMPLE_BYTES, 0)
    starts = [start + span * k // (SAMPLES - 1) for k in range(SAMPLES)]
    return [(at, max(min(SAMPLE_BYTES, end - at), 0)) for at in starts]


def samples_digest(samples: Iterable[bytes]) -> str:
    """The fingerprint's digest of a file's data samples, read at `sample_ranges`."""
    h = hashlib.sha256()
    for sample in samples:
        h.update(sample)
    return h.hexdigest()


def header_of(
    name: Path, size: int, header: bytes, samples: str, source: SourceFile
) -> SafetensorsFile:
    """A header read from elsewhere than a file here (an object of a store), parsed and
    validated as read_header's; `name`: the file's name in the checkpoint."""
    return SafetensorsFile(
        path=name,
        size=size,
        header=header,
        tensors=_parse(name, name, header, size),
        samples=samples,
        source=source,
    )


def _entry(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r}: {problem}; fetch the file again")

    if not isinstance(info, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise bad(f"data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    if not 0 <= begin <= end:
        raise bad(f"data_offsets [{begin}, {end}] are reversed or negative")
    if end - begin != nbytes:
        raise bad(
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes, {dtype}{shape} needs {nbytes}"
        )
    if end > data_size:
        raise bad(
            f"data_offsets end {end} lies past the file's {data_size} data bytes (truncated file)"
        )
    return TensorEntry(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        file=path,
        offset=data_start + begin,
        nbytes=nbytes,
    )
