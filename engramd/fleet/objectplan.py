"""Plans of checkpoints that live in an object store (`--checkpoint s3://bucket/prefix`).

A node that streams its weights from object storage may hold no file of the
checkpoint. Its set is planned from the objects as plan_tables plans a
folder: the index (or, without one, the `*.safetensors` objects under the
prefix), config.json's architectures (both read whole, bounded), and of each
object its size, its header and the data samples of the fingerprint, each by
a ranged read (s3api.py). The set id is the one a folder of the same files
gets, so the peers that loaded the checkpoint from disk offer this node their
copies. No byte of such a plan is checked against local files: the set's
bytes are trusted by the fleet's attested manifest alone (fleet/trust.py).

What the bucket's writers, and whoever answers for the endpoint, can make a
planning node spend is bounded:

- time: each request ends within s3api.REQUEST_TIMEOUT_S (30 s), head
  included, and a planning within PLANNING_TIMEOUT_S (120 s); then it fails
  as a store that does not answer (StoreUnreadable), and a configured
  checkpoint whose attested copy the node holds serves that copy;
- memory: what a planning holds is charged to PLANNING_MEMORY, one limit
  for every planning of the process at once (PLANNING_BYTES, 384 MiB),
  before it is read or parsed: each body or header read (the index,
  config.json, a listing's pages, each object's header) at COPIES times its
  bytes (the bytes and their decoded text), and each JSON or XML value in it
  (counted by its delimiters before parsing) at VALUE_BYTES, above what
  json.loads and the parsed entries take for one. A planning that cannot be
  charged waits for others to end (within its deadline); one that alone
  would pass the limit fails at once, naming it. Beside that, each planning
  thread's first read (FIRST_READ_BYTES);
- CPU: parsing is linear in the values charged, so a planning's CPU is
  bounded with its memory (about 3 CPU-s at the whole limit, measured by
  bench/proof.py), and by its deadline.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from engramd.fleet.s3api import (
    COPIES,
    ObjectReader,
    StoreAccess,
    StoreError,
    parse_cost,
)
from engramd.sets.seams import StoreUnreadable
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
#: Seconds a planning may take in all: then the store counts as not answering.
PLANNING_TIMEOUT_S = 120.0
#: What every planning of the process may hold at once, all together (bytes read, text
#: decoded, values parsed; see the module's docstring). DeepSeek-V4.1-Flash's 163 headers
#: (about 30 MiB, 730,000 JSON values) are charged about 260 MiB.
PLANNING_BYTES = 384 << 20
#: The index's bytes read at most (DeepSeek-V4.1-Flash's: about 8 MiB).
MAX_INDEX_BYTES = 32 << 20


def plan_objects(url: str, selection: str, env: Mapping[str, str] = os.environ) -> TablePlan:
    """The plan of the checkpoint under `url` (s3://bucket/prefix); blocks (run it on a
    thread). Raises CheckpointError naming the object and the fix."""
    try:
        access = StoreAccess.of(url, env, "--checkpoint")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    where = access.url
    deadline = time.monotonic() + PLANNING_TIMEOUT_S
    reader = ObjectReader(access, deadline=deadline)
    with PLANNING_MEMORY.charges(where, deadline) as held:
        try:
            index = _whole(reader, held, INDEX_FILE, MAX_INDEX_BYTES)
            weight_map = None if index is None else weight_map_in(f"{where}/{INDEX_FILE}", index)
            del index
            if weight_map is not None:
                names = listed_files(f"{where}/{INDEX_FILE}", weight_map)
                if not names:
                    raise CheckpointError(f"{where}/{INDEX_FILE} lists no files; upload it again")
            else:
                names = reader.names(".safetensors", held)
                if not names:
                    raise CheckpointError(
                        f"{where}: no *.safetensors objects and no {INDEX_FILE} there; upload "
                        "the checkpoint's files under that prefix, or name the prefix that "
                        "holds them"
                    )
            if len(names) > MAX_OBJECTS:
                raise CheckpointError(
                    f"{where}: {len(names)} files, more than the {MAX_OBJECTS} engramd plans"
                )
            config = _whole(reader, held, CONFIG_FILE, MAX_CONFIG_BYTES)
            pool = ThreadPoolExecutor(min(PLANNING_READS, len(names)))
            try:
                headers = list(pool.map(partial(_header, reader, where, held), names))
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
        objects = {str(h.path): h.size for h in headers}
        del headers, weight_map
    return TablePlan(
        checkpoint=Path(where),
        selection=selection,
        tensors=join_shards(where, selected),
        fingerprint=fingerprint,
        set_id=set_id_of(fingerprint),
        store=where,
        objects=objects,
    )


class PlanningMemory:
    """What every store planning of the process holds at once, charged before it is read or
    parsed, within one limit: whoever writes a bucket, or answers for its endpoint, must not
    have the daemon hold gigabytes of JSON, however many plannings run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes charged now, all plannings together."""
        return self._held

    def charges(self, where: str, deadline: float) -> PlanningCharges:
        """A planning's charges, given back when it ends (a `with` block)."""
        return PlanningCharges(self, where, deadline)

    def take(self, n: int, deadline: float) -> bool:
        """Charge `n` bytes once the limit allows, waiting for other plannings until
        `deadline`; False when it passed first."""
        with self._changed:
            while self._held + n > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self._held += n
            return True

    def give(self, n: int) -> None:
        """Give back `n` bytes charged."""
        with self._changed:
            self._held -= n
            self._changed.notify_all()


#: The one limit of every planning of this process.
PLANNING_MEMORY = PlanningMemory(PLANNING_BYTES)


class PlanningCharges:
    """One planning's charges to PlanningMemory: refused at once past the whole limit,
    waited for within the planning's deadline otherwise; all given back at its end."""

    def __init__(self, memory: PlanningMemory, where: str, deadline: float) -> None:
        self._memory = memory
        self._where = where
        self._deadline = deadline
        self._held = 0
        self._ended = False
        self._lock = threading.Lock()

    def __enter__(self) -> PlanningCharges:
        return self

    def __exit__(self, *_: object) -> None:
        # Reads the planning left running (a failed object ends it) charge nothing more.
        with self._lock:
            held, self._held, self._ended = self._held, 0, True
        self._memory.give(held)

    def charge(self, n: int) -> None:
        """Charge `n` more bytes to this planning; CheckpointError when they would take it past
        the limit, StoreError when other plannings hold the room until its deadline."""
        with self._lock:
            if self._ended:
                raise StoreError(f"{self._where}: the planning ended")
            if self._held + n > self._memory.limit:
                raise CheckpointError(
                    f"{self._where}: planning its objects would take more than "
                    f"{self._memory.limit >> 20} MiB of memory (their index, listing and headers "
                    "hold more entries than any checkpoint's); name the prefix of a checkpoint's "
                    "files"
                )
            self._held += n
        taken = self._memory.take(n, self._deadline)
        with self._lock:
            if taken and not self._ended:
                return
            self._held -= 0 if self._ended else n
        if taken:
            self._memory.give(n)
            raise StoreError(f"{self._where}: the planning ended")
        raise StoreError(
            f"{self._where}: other plannings held the memory of plannings "
            f"({self._memory.limit >> 20} MiB) until this one's time was up"
        )

    def charge_parse(self, text: bytes) -> None:
        """Charge what parsing `text` (read and charged already) may take."""
        self.charge(parse_cost(text))

    def give(self, n: int) -> None:
        """Give back `n` bytes this planning holds no more (a listing's page, parsed)."""
        with self._lock:
            if self._ended:
                return
            self._held -= n
        self._memory.give(n)


def _whole(reader: ObjectReader, held: PlanningCharges, name: str, limit: int) -> bytes | None:
    """A small whole object (the index, config.json), charged before it is read and parsed;
    None when there is none."""
    held.charge(COPIES * limit)
    body = reader.get(name, limit)
    if body is not None:
        held.charge_parse(body)
    return body


def _header(reader: ObjectReader, where: str, held: PlanningCharges, name: str) -> SafetensorsFile:
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
    held.charge(COPIES * length)
    header = first[8 : 8 + length]
    if len(header) < length:
        header += _read(reader, where, name, 8 + len(header), length - len(header), size)
    held.charge_parse(header)
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
