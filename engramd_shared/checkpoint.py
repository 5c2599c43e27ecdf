"""A checkpoint's table set: its files, the selected tensors, their fingerprint and set id.

A checkpoint is one safetensors file or a folder of them (with or without
`model.safetensors.index.json`); only their headers are read
(`headers.py`). The set id is derived from what the files are and
which tensors were taken, so copies of one checkpoint on different mounts
agree.

Row shards of one table (`X.shard_0.Y`, `X.shard_1.Y`, ...: Qwen4Exp's PLE
n-gram table) are joined into one tensor `X.Y` of the set, the shards' rows
back to back in shard order: an engine's vocab range crosses shard
boundaries, and its kernels index one contiguous table.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engramd_shared.errors import CheckpointError
from engramd_shared.families import AUTO, CONFIG_FILE, architectures_of, family_of
from engramd_shared.fileid import SourceFile, open_regular
from engramd_shared.headers import (
    MAX_HEADER_BYTES,
    Admit,
    SafetensorsFile,
    TensorEntry,
    bounded_int,
    read_header,
)

if TYPE_CHECKING:
    from engramd_shared.beneath import Opened, Root

#: Selection used when none is given: the tables of the checkpoint's family (families.py).
DEFAULT_TENSORS = AUTO

#: Bumped whenever the on-tmpfs layout changes; part of every set id.
LAYOUT_VERSION = 1

INDEX_FILE = "model.safetensors.index.json"

#: A row shard of a table: (table).shard_(index).(part).
_SHARD = re.compile(r"^(.+)\.shard_([0-9]+)\.([^.]+)$")


@dataclass(frozen=True)
class TablePlan:
    """The selected tensors of one checkpoint and the identity of their bytes."""

    #: The checkpoint folder (or file), resolved; a plan from an object store has no path
    #: here (its URL as a Path: name it by `where`).
    checkpoint: Path
    selection: str
    tensors: tuple[TensorEntry, ...]
    fingerprint: str
    set_id: str
    #: The files the selected tensors live in, as they were when planned.
    sources: tuple[SourceFile, ...] = ()
    #: A plan made beneath a root (the daemon's, for workers): each source's file, by its
    #: path, as the walk opened it and the headers were read from it, held open.
    held: Mapping[str, Opened] = field(default_factory=dict, compare=False, repr=False)
    #: s3://bucket/prefix for a plan made from an object store's objects: no file of the
    #: checkpoint is on this node (no sources); each tensor's file is its object's name.
    store: str = ""
    #: The size of each object (by name) a plan from an object store read.
    objects: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def where(self) -> str:
        """The checkpoint as the operator named it: its folder (or file), or its store's URL."""
        return self.store or str(self.checkpoint)

    @property
    def nbytes(self) -> int:
        """The selected tensors' bytes, without padding."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def files(self) -> frozenset[Path]:
        """The checkpoint files the set's bytes come from."""
        return frozenset(p.file for t in self.tensors for p in t.spans)

    @property
    def checkpoint_names(self) -> dict[str, tuple[str, ...]]:
        """Each set tensor's checkpoint tensors (a joined table's shards, in order)."""
        return {t.name: tuple(p.name for p in t.spans) for t in self.tensors}


def checkpoint_files(checkpoint: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint folder (or file) and its index's weight map."""
    if checkpoint.is_file():
        return [checkpoint], None
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint file or folder")
    index_path = checkpoint / INDEX_FILE
    if index_path.exists():
        fd = open_regular(index_path)
        try:
            weight_map = _weight_map(index_path, fd)
        finally:
            os.close(fd)
        return [checkpoint / n for n in listed_files(index_path, weight_map)], weight_map
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint}: no *.safetensors files in this folder")
    return files, None


@dataclass(frozen=True, eq=False)
class FilesBeneath:
    """A checkpoint's files as a walk beneath a root found them, each held open."""

    #: The checkpoint (folder or file) where the walk found it.
    top: Opened
    #: Its index, if it has one.
    index: Opened | None
    weight_map: dict[str, str] | None
    #: Its safetensors files as it names them (the folder's path joined with each name).
    names: tuple[Path, ...]
    #: Each of them as the walk found and opened it (symlinks followed), in that order.
    files: tuple[Opened, ...]
    #: The architectures its config.json names, read beneath the root ([]: none).
    architectures: list[str] = field(default_factory=list)


def files_beneath(checkpoint: Path, beneath: Root) -> FilesBeneath:
    """The files of `checkpoint` (as checkpoint_files lists them), opened beneath `beneath`."""
    top = beneath.open(checkpoint)
    if not stat.S_ISDIR(top.file.stat().st_mode):
        return FilesBeneath(top, None, None, (top.path,), (top,))
    names = beneath.listdir(top)
    index = weight_map = None
    if INDEX_FILE in names:
        index = beneath.open(Path(INDEX_FILE), top)
        weight_map = _weight_map(index.path, index.fd)
        listed = listed_files(index.path, weight_map)
    else:
        listed = sorted(n for n in names if fnmatch.fnmatchcase(n, "*.safetensors"))
        if not listed:
            raise CheckpointError(f"{checkpoint}: no *.safetensors files in this folder")
    files = tuple(beneath.open(Path(name), top) for name in listed)
    named: list[str] = []
    # A config.json that leaves the root, or is no file, decides nothing: the tensors do.
    with contextlib.suppress(CheckpointError):
        if CONFIG_FILE in names:
            named = architectures_of(beneath.open(Path(CONFIG_FILE), top).fd)
    paths = tuple(top.path / n for n in listed)
    return FilesBeneath(top, index, weight_map, paths, files, named)


def _weight_map(index_path: Path, fd: int) -> dict[str, str]:
    try:
        with open(os.dup(fd), "rb") as f:
            f.seek(0)
            text = f.read(MAX_HEADER_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{index_path}: malformed index ({e!r})") from None
    return weight_map_in(index_path, text)


def weight_map_in(index_path: Path | str, text: bytes) -> dict[str, str]:
    """The weight map of an index's text; CheckpointError naming `index_path` if malformed."""
    try:
        if len(text) > MAX_HEADER_BYTES:
            raise ValueError(f"larger than {MAX_HEADER_BYTES} bytes")
        weight_map = json.loads(text, parse_int=bounded_int)["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not an object of strings")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{index_path}: malformed index ({e!r})") from None
    return weight_map


def listed_files(index_path: Path | str, weight_map: dict[str, str]) -> list[str]:
    """The files an index's weight map names, each refused unless a name inside the folder."""
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{index_path}: file {name!r} is not inside the folder")
    return names


def plan_tables(
    checkpoint: str | os.PathLike[str],
    selection: str = DEFAULT_TENSORS,
    beneath: Root | None = None,
    max_header: int = MAX_HEADER_BYTES,
    admit: Admit | None = None,
) -> TablePlan:
    """Read the headers of a checkpoint and select the tensors of its table set.

    With `beneath` (the daemon, for a worker's checkpoint) every file is
    opened by a walk beneath that root before a byte of it is read, and the
    plan holds the files it read (`TablePlan.held`). `max_header` and
    `admit`: as read_header's.
    """
    opened: tuple[Opened, ...] = ()
    named: list[str] | None = None
    if beneath is None:
        try:
            root = Path(checkpoint).resolve()
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL byte
            raise CheckpointError(f"{checkpoint!r}: not a usable checkpoint path ({e})") from None
        files, weight_map = checkpoint_files(root)
        headers = [read_header(p) for p in files]
    else:
        found = files_beneath(Path(checkpoint), beneath)
        root, weight_map, opened = found.top.path, found.weight_map, found.files
        named = found.architectures
        files = list(found.names)
        headers = [read_header(p, o, max_header, admit) for p, o in zip(files, opened, strict=True)]
    selection, selected = select_tensors(root, headers, weight_map, selection, named)
    fingerprint = fingerprint_of(headers, selected)
    used = {t.file for t in selected}
    return TablePlan(
        checkpoint=root,
        selection=selection,
        tensors=join_shards(root, selected),
        fingerprint=fingerprint,
        set_id=set_id_of(fingerprint),
        sources=tuple(h.source for h in headers if Path(h.source.path) in used),
        held={str(o.path): o for o in opened if o.path in used},
    )


def select_tensors(
    where: Path | str,
    headers: list[SafetensorsFile],
    weight_map: dict[str, str] | None,
    selection: str,
    named: list[str] | None,
) -> tuple[str, tuple[TensorEntry, ...]]:
    """The selection (auto resolved to the family's) and the tensors of the checkpoint at
    `where` it selects, in name order; `named`: its config.json's architectures (None: read
    them from the folder `where`)."""
    by_name: dict[str, TensorEntry] = {}
    file_of: dict[str, str] = {}
    for h in headers:
        by_name.update(h.tensors)
        file_of.update(dict.fromkeys(h.tensors, h.path.name))
    if weight_map is not None:
        for name, file in weight_map.items():
            if file_of.get(name) != file:
                raise CheckpointError(
                    f"{where}/{file}: tensor {name!r} is listed in {INDEX_FILE} but missing "
                    "from that file; fetch the checkpoint again"
                )
    if selection == AUTO:
        selection = family_of(where, by_name, named).selection
    selected = tuple(by_name[n] for n in sorted(by_name) if fnmatch.fnmatchcase(n, selection))
    if not selected:
        raise CheckpointError(
            f"{where}: no tensor matches {selection!r} among {len(by_name)} tensors; "
            "pass the right selection (tensors=...)"
        )
    return selection, selected


def join_shards(root: Path | str, selected: tuple[TensorEntry, ...]) -> tuple[TensorEntry, ...]:
    """The set's tensors: `selected`, with every table's row shards joined into one.

    Raises CheckpointError for shards that cannot be one table: a missing
    shard, or shards of different dtypes or row widths.
    """
    tables: dict[str, dict[int, TensorEntry]] = {}
    tensors = {}
    for t in selected:
        shard = _SHARD.match(t.name)
        if shard is None:
            tensors[t.name] = t
            continue
        table, index, part = shard.groups()
        tables.setdefault(f"{table}.{part}", {})[int(index)] = t
    for name, shards in tables.items():
        parts = tuple(shards[i] for i in range(len(shards)) if i in shards)
        first = parts[0] if parts else None
        if len(parts) != len(shards) or first is None:
            missing = min(set(range(len(shards))) - set(shards))
            raise CheckpointError(
                f"{root}: the row shards of {name!r} skip shard {missing} "
                f"({len(shards)} shards, up to shard {max(shards)}); fetch the checkpoint again"
            )
        if not first.shape or any(
            (p.dtype, p.shape[1:]) != (first.dtype, first.shape[1:]) or not p.shape for p in parts
        ):
            raise CheckpointError(
                f"{root}: the row shards of {name!r} differ in dtype or row width "
                f"({sorted({(p.dtype, p.shape[1:]) for p in parts})}); they cannot be one table"
            )
        if name in tensors:
            raise CheckpointError(
                f"{root}: {name!r} is both a tensor and the table its row shards make; "
                "select one of them (tensors=...)"
            )
        tensors[name] = TensorEntry(
            name=name,
            dtype=first.dtype,
            shape=(sum(p.shape[0] for p in parts), *first.shape[1:]),
            file=first.file,
            offset=first.offset,
            nbytes=sum(p.nbytes for p in parts),
            parts=parts,
        )
    return tuple(tensors[n] for n in sorted(tensors))


def fingerprint_of(headers: list[SafetensorsFile], selected: tuple[TensorEntry, ...]) -> str:
    """The fingerprint of a checkpoint's files (`headers`) and the tensors taken of them."""
    # Identifies the bytes without reading them all: what each file is (name,
    # size, header, samples of its data) and which tensors were taken. Folder
    # paths and mtimes are left out so that copies of one checkpoint on
    # different mounts agree.
    h = hashlib.sha256()
    for f in sorted(headers, key=lambda f: f.path.name):
        h.update(f"{f.path.name}\0{f.size}\0{len(f.header)}\0{f.samples}\0".encode())
        h.update(f.header)
    for t in selected:
        h.update(f"\0{t.name}".encode())
    return h.hexdigest()


def set_id_of(fingerprint: str) -> str:
    """The set id of a fingerprint under this layout version."""
    return hashlib.sha256(f"engramd-layout-{LAYOUT_VERSION}:{fingerprint}".encode()).hexdigest()[
        :20
    ]


def is_store_url(text: str) -> bool:
    """True when `text` names a checkpoint in an object store (s3://bucket/prefix), not a path."""
    return text.startswith("s3://")


def is_set_id(text: str) -> bool:
    """True when `text` has the shape of a set id."""
    return len(text) == 20 and all(c in "0123456789abcdef" for c in text)
