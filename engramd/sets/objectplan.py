"""Plans of checkpoints that live in an object store (`--checkpoint s3://bucket/prefix`).

A node that streams its weights from object storage may hold no file of the
checkpoint. Its set is planned from the objects as plan_tables plans a
folder: the index (or, without one, the `*.safetensors` objects under the
prefix), config.json's architectures (both read whole, bounded), and of each
object its size, its header and the data samples of the fingerprint, each by
a ranged read (s3api.py). What the bucket's writers can make the daemon read
is bounded (MAX_OBJECTS, STORE_HEADER_BYTES, the listing's pages, each
request's deadline). The set id is the one a folder of the same files gets, so the
peers that loaded the checkpoint from disk offer this node their copies.
No byte of such a plan is checked against local files: the set's bytes are
trusted by the fleet's attested manifest alone (sources/trust.py).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from engramd.sources.s3api import ObjectReader, StoreAccess, StoreError
from engramd_shared.checkpoint import (
    INDEX_FILE,
    TablePlan,
    fingerprint_of,
    join_shards,
    listed_files,
    select_tensors,
    set_id_of,
    weight_map_in,
)
from engramd_shared.errors import CheckpointError
from engramd_shared.families import CONFIG_FILE, MAX_CONFIG_BYTES, architectures_in
from engramd_shared.fileid import SourceFile
from engramd_shared.headers import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    header_of,
    sample_ranges,
    samples_digest,
)

#: The first read of each object: its header's length, and most headers whole.
FIRST_READ_BYTES = 256 << 10
#: Objects read at once while planning (each a few small ranged GETs).
PLANNING_READS = 16
#: Files of one checkpoint planned at most (DeepSeek-V4.1-Flash has 163).
MAX_OBJECTS = 4096
#: Bytes of all of one checkpoint's headers read at most (163 shards: about 30 MiB).
STORE_HEADER_BYTES = 512 << 20


def plan_objects(url: str, selection: str, env: Mapping[str, str] = os.environ) -> TablePlan:
    """The plan of the checkpoint under `url` (s3://bucket/prefix); blocks (run it on a
    thread). Raises CheckpointError naming the object and the fix."""
    try:
        access = StoreAccess.of(url, env, "--checkpoint")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    where = access.url
    reader = ObjectReader(access)
    try:
        index = reader.get(INDEX_FILE, MAX_HEADER_BYTES)
        weight_map = None if index is None else weight_map_in(f"{where}/{INDEX_FILE}", index)
        if weight_map is not None:
            names = listed_files(f"{where}/{INDEX_FILE}", weight_map)
            if not names:
                raise CheckpointError(f"{where}/{INDEX_FILE} lists no files; upload it again")
        else:
            names = reader.names(".safetensors")
            if not names:
                raise CheckpointError(
                    f"{where}: no *.safetensors objects and no {INDEX_FILE} there; upload the "
                    "checkpoint's files under that prefix, or name the prefix that holds them"
                )
        if len(names) > MAX_OBJECTS:
            raise CheckpointError(
                f"{where}: {len(names)} files, more than the {MAX_OBJECTS} engramd plans"
            )
        config = reader.get(CONFIG_FILE, MAX_CONFIG_BYTES)
        budget = _HeaderBudget(STORE_HEADER_BYTES, where)
        pool = ThreadPoolExecutor(min(PLANNING_READS, len(names)))
        try:
            headers = list(pool.map(partial(_header, reader, where, budget), names))
        finally:
            # A failed object ends the planning: the reads not started are not.
            pool.shutdown(wait=False, cancel_futures=True)
    except StoreError as e:
        raise StoreUnreadable(
            f"cannot plan the checkpoint at {where}: {e}; check the URL, the AWS_ variables "
            "(endpoint, static keys, region) and that the daemon may read the bucket"
        ) from None
    named = architectures_in(config) if config is not None else []
    selection, selected = select_tensors(where, headers, weight_map, selection, named)
    fingerprint = fingerprint_of(headers, selected)
    return TablePlan(
        checkpoint=Path(where),
        selection=selection,
        tensors=join_shards(where, selected),
        fingerprint=fingerprint,
        set_id=set_id_of(fingerprint),
        store=where,
        objects={str(h.path): h.size for h in headers},
    )


class StoreUnreadable(CheckpointError):
    """The store did not give the objects: unreachable, refused, or no S3 in its answers
    (not a checkpoint that is malformed)."""


class _HeaderBudget:
    """The headers' bytes one planning may read, all objects together: whoever writes the
    bucket must not have the daemon hold gigabytes of JSON."""

    def __init__(self, limit: int, where: str) -> None:
        self._left = limit
        self._limit = limit
        self._where = where
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Count a header of `n` bytes; CheckpointError once the headers pass the limit."""
        with self._lock:
            self._left -= n
            if self._left < 0:
                raise CheckpointError(
                    f"{self._where}: the objects' headers pass {self._limit >> 20} MiB, more "
                    "than any checkpoint's; name the prefix of a checkpoint's files"
                )


def _header(reader: ObjectReader, where: str, budget: _HeaderBudget, name: str) -> SafetensorsFile:
    """The header of the object of file `name`, parsed, with its size and data samples."""
    first, size = reader.read(name, 0, FIRST_READ_BYTES)
    if len(first) < 8:
        raise CheckpointError(
            f"{where}/{name}: {size} bytes is too short for a safetensors file (a truncated "
            "upload?); upload the file again"
        )
    (length,) = struct.unpack("<Q", first[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CheckpointError(
            f"{where}/{name}: header length {length} runs past the object's {size} bytes "
            "(truncated or not a safetensors file); upload the file again"
        )
    budget.take(length)
    header = first[8 : 8 + length]
    if len(header) < length:
        header += _read(reader, where, name, 8 + len(header), length - len(header), size)
    samples = [
        _read(reader, where, name, at, n, size) if n else b""
        for at, n in sample_ranges(8 + length, size)
    ]
    source = SourceFile(path=name, dev=0, ino=0, size=size, mtime_ns=0, ctime_ns=0)
    try:
        return header_of(Path(name), size, header, samples_digest(samples), source)
    except CheckpointError as e:
        # Its message names the file by its name: name the object, and the fix there.
        fix = str(e).replace("fetch the file again", "upload the file again")
        raise CheckpointError(f"{where}/{fix}") from None


def _read(reader: ObjectReader, where: str, name: str, at: int, n: int, size: int) -> bytes:
    """Bytes `at`..`at + n` of an object of `size` bytes; CheckpointError when it changed."""
    data, now = reader.read(name, at, n)
    if now != size:
        raise CheckpointError(
            f"{where}/{name}: the object changed while it was read ({size} bytes, now {now}); "
            "plan it again once its upload is done"
        )
    if len(data) != n:
        raise StoreUnreadable(
            f"{where}/{name}: the store sent {len(data)} of bytes {at}-{at + n - 1} of "
            f"{size}: a short reply; plan it again"
        )
    return data
