"""Fill a set from an object store (s3://bucket/prefix) through NIXL's OBJ backend.

The bucket holds the checkpoint's safetensors files under the names the
checkpoint folder gives them (`<prefix>/<name>`), and beside them the set's
attested manifest (`<prefix>/engramd-manifest-<set_id>.json`, made by
`engramd manifest` on a machine with the fleet's token: trust.py). That
manifest is read first and must be this set's, attested by the fleet's key;
a store without one is refused (the files then fill the set). Before a byte
of a tensor is read, each object must match the node's file where the set
id looks: the header, and the data samples the fingerprint takes (the last
of which ends at the file's end, so a truncated object fails here). Then
every tensor is read by ranges into the landing ring of the fill's transfer
process (landing.py), moved into the staged set and digested there, and
spot-checked against the node's file; its strong digest and checksum
must be the attested ones. A checkpoint planned from the store itself
(`--checkpoint s3://...`, fleet/objectplan.py) has no node file to compare
with: its objects are read unchecked and the attested digests alone decide.
Endpoint and keys come the way the AWS tools take them (s3api.py).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from engramd.backings.regions import Region
from engramd.fleet.base import SourceFailed, overlaps, spans, spot_check_set
from engramd.fleet.inflight import InOrder
from engramd.fleet.landing import Landing
from engramd.fleet.nixlxfer import Agent, TransferFailed
from engramd.fleet.s3api import ObjectReader, StoreAccess, StoreError
from engramd.fleet.trust import (
    OBJECT_HEADER_BYTES,
    OBJECT_MAX_BYTES,
    AttestedManifest,
    FleetKey,
    check_received,
    manifest_key,
)
from engramd.sets.seams import Filled, FillProgress
from engramd.strong import pieces
from engramd_shared.checkpoint import TablePlan, checkpoint_files
from engramd_shared.fileid import open_regular
from engramd_shared.headers import TensorEntry, sample_ranges

#: Windows per NIXL request: the OBJ backend reads a request's ranges on its own threads.
WINDOWS_PER_READ = 8
#: Requests in flight: one is digested while the next is read.
READS_IN_FLIGHT = 2
#: Threads of the OBJ backend.
OBJ_THREADS = 4
#: Seconds one window may take.
WINDOW_TIMEOUT_S = 60.0
#: The NIXL OBJ device of the attested manifest (the checkpoint's files are 0, 1, ...).
MANIFEST_DEVICE = 1 << 20
#: Bytes of an attested manifest read before a set is reserved, per tensor of the set.
VOUCH_BYTES = 8 << 10
#: Seconds the read of the attested manifest before a set is reserved may take.
VOUCH_TIMEOUT_S = 30.0


class StoreUnanswered(SourceFailed):
    """The store gave no answer to a read (not a refusal, not a bad object)."""


class ObjectStoreSource:
    """Fills sets from `s3://bucket/prefix`; one fill at a time, each with a transfer process."""

    def __init__(self, url: str, key: FleetKey | None, env: Mapping[str, str] = os.environ) -> None:
        #: Where the store is and its keys.
        self.access = StoreAccess.of(url, env, "--object-store")
        #: The store as status names it.
        self.url = self.access.url
        self._bucket = self.access.bucket
        self._prefix = self.access.prefix
        #: The fleet's key, which the set's attested manifest must be made with.
        self._fleet = key
        self._lock = threading.Lock()

    def key(self, name: str) -> str:
        """The object key of a checkpoint file named `name`."""
        return self.access.key(name)

    def agent(self) -> Agent:
        """A transfer process with the OBJ backend for this store (given the daemon's AWS_
        variables; nothing listens there)."""
        return Agent({"OBJ": self.access.nixl_params(OBJ_THREADS)})

    def register(self, agent: Agent, plan: TablePlan) -> dict[str, int]:
        """Register with `agent` the objects of the files `plan` reads; each file's (by its
        real path) OBJ device, for `object_ranges`."""
        return self._register(agent, _names(plan))

    def _register(self, agent: Agent, files: dict[str, tuple[str, int]]) -> dict[str, int]:
        devices = {path: i for i, path in enumerate(files)}
        agent.register(
            [(0, size, devices[path], self.key(name)) for path, (name, size) in files.items()],
            "OBJ",
        )
        return devices

    def fill(self, plan: TablePlan, regions: list[Region], progress: FillProgress) -> Filled:
        """Read the set of `plan` into `regions`; the digests and the attestation they matched.
        Raises SourceFailed."""
        with self._lock, self.agent() as agent:
            attested = self._attested(agent, plan, progress)
            with Landing(agent, regions, READS_IN_FLIGHT * WINDOWS_PER_READ) as landing:
                self._fill(agent, landing, plan, progress)
                got = landing.digests()
        check_received(
            [t.name for t in attested.tensors],
            [t.strong for t in attested.tensors],
            got,
            "the bucket holds other bytes than the checkpoint's",
        )
        spot_check_set(plan, [r.view() for r in regions])
        # Every byte has the attested strong digest: the attested checksums are theirs.
        return Filled([t.checksum for t in attested.tensors], got, attested.attestation)

    def _attested(self, agent: Agent, plan: TablePlan, progress: FillProgress) -> AttestedManifest:
        """The set's attested manifest from the bucket, once it proved to be this set's,
        attested by the fleet's key."""
        key = manifest_key(self._prefix, plan.set_id)
        where = f"s3://{self._bucket}/{key}"
        if self._fleet is None:
            raise SourceFailed(
                f"no fleet token to check {where} with: an object-store fill needs "
                "--peer-token-file (the key of the set's attested manifest)"
            )
        agent.register([(0, OBJECT_HEADER_BYTES + OBJECT_MAX_BYTES, MANIFEST_DEVICE, key)], "OBJ")
        header = self._read_object(agent, where, 0, OBJECT_HEADER_BYTES, progress)
        try:
            length = AttestedManifest.body_length(header)
        except ValueError as e:
            raise SourceFailed(f"{where}: {e}") from None
        body = self._read_object(agent, where, OBJECT_HEADER_BYTES, length, progress)
        return self._checked(body, plan, where)

    def vouch(self, plan: TablePlan) -> None:
        """Return when the bucket's attested manifest covers the set of `plan` (its id, each
        tensor's name, dtype, shape and size), attested by the fleet's key; SourceFailed
        otherwise. A few plain signed GETs (s3api.py), no transfer process: nothing of the
        set is reserved before an attestation covers it."""
        key = manifest_key(self._prefix, plan.set_id)
        where = f"s3://{self._bucket}/{key}"
        if self._fleet is None:
            raise SourceFailed(f"no fleet token to check {where} with")
        # A manifest is a few hundred bytes a tensor: no more is read, nor parsed.
        limit = min(OBJECT_MAX_BYTES, VOUCH_BYTES * (len(plan.tensors) + 1))
        reader = ObjectReader(self.access, deadline=time.monotonic() + VOUCH_TIMEOUT_S)
        try:
            found = reader.get(key.rpartition("/")[2], OBJECT_HEADER_BYTES + limit)
        except StoreError as e:
            raise StoreUnanswered(f"{where}: {e}") from None
        if found is None:
            raise SourceFailed(f"{where}: no attested manifest there")
        try:
            length = AttestedManifest.body_length(found[:OBJECT_HEADER_BYTES])
        except ValueError as e:
            raise SourceFailed(f"{where}: {e}") from None
        if length != len(found) - OBJECT_HEADER_BYTES:
            raise SourceFailed(f"{where}: {len(found)} bytes, its header says {length} follow")
        self._checked(found[OBJECT_HEADER_BYTES:], plan, where)

    def _checked(self, body: bytes, plan: TablePlan, where: str) -> AttestedManifest:
        """The attested manifest in `body`, once it proved to be this set's, attested by the
        fleet's key; SourceFailed otherwise."""
        assert self._fleet is not None
        try:
            attested = AttestedManifest.from_body(body)
        except (ValueError, KeyError, TypeError) as e:
            raise SourceFailed(f"{where} does not parse ({e!r})") from None
        theirs = [(t.name, t.dtype, t.shape, t.nbytes) for t in attested.tensors]
        mine = [(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in plan.tensors]
        if (attested.set_id, attested.fingerprint, theirs) != (
            plan.set_id,
            plan.fingerprint,
            mine,
        ):
            raise SourceFailed(f"{where} describes another set than this checkpoint's")
        if not self._fleet.attested(
            attested.attestation,
            attested.set_id,
            attested.fingerprint,
            attested.tensors,
            [t.strong for t in attested.tensors],
        ):
            raise SourceFailed(
                f"{where} carries no valid attestation of the fleet's key (not made by "
                "`engramd manifest` with this fleet's token, or altered since)"
            )
        return attested

    def _read_object(
        self, agent: Agent, where: str, at: int, n: int, progress: FillProgress
    ) -> bytes:
        """Bytes `at`..`at + n` of the attested manifest's object."""
        try:
            return _read_ranges(agent, [(at, n, MANIFEST_DEVICE)], progress)
        except TransferFailed as e:
            raise SourceFailed(
                f"{where}: cannot read the set's attested manifest ({e}); make it with "
                "`engramd manifest CHECKPOINT` and upload it there"
            ) from None

    def _fill(
        self, agent: Agent, landing: Landing, plan: TablePlan, progress: FillProgress
    ) -> None:
        files = _names(plan)
        devices = self._register(agent, files)
        # A plan made from these objects has no file to compare them with.
        for path, (name, size) in files.items() if not plan.store else ():
            self._check_object(agent, path, self.key(name), size, devices[path], progress)
        # A window is a piece of the strong digest, digested as it lands; a piece of a
        # table joined from row shards may take a range of each of two shards' objects.
        windows = [
            (i, at, object_ranges(t, at, n, devices))
            for i, t in enumerate(plan.tensors)
            for at, n in pieces(t.nbytes)
        ]
        reads = InOrder(agent, progress, READS_IN_FLIGHT, self.url)
        for k in range(0, len(windows), WINDOWS_PER_READ):
            batch = [(*landing.slot(), *window) for window in windows[k : k + WINDOWS_PER_READ]]
            local, remote = [], []
            for _, there, _, _, ranges in batch:
                for into, (offset, n, device) in ranges:
                    local.append((there + into, n, 0))
                    remote.append((offset, n, device))
            handle = agent.post(local, remote, "OBJ", agent.name)
            deadline = time.monotonic() + WINDOW_TIMEOUT_S * len(batch)
            reads.add(
                handle,
                sum(n for _, n, _ in local),
                deadline,
                partial(_move, landing, [(slot, i, at) for slot, _, i, at, _ in batch]),
            )
        reads.finish()

    def _check_object(
        self, agent: Agent, path: str, key: str, size: int, device: int, progress: FillProgress
    ) -> None:
        """The object's header and the fingerprint's samples, as the node's file has them."""
        fd = open_regular(Path(path))
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            ranges = [(0, 8 + length), *sample_ranges(8 + length, size)]
            ranges = [(at, n) for at, n in ranges if n > 0]
            expected = [os.pread(fd, n, at) for at, n in ranges]
        finally:
            os.close(fd)
        try:
            got = _read_ranges(agent, [(at, n, device) for at, n in ranges], progress)
        except TransferFailed as e:
            raise SourceFailed(
                f"s3://{self._bucket}/{key}: cannot read its header and samples ({e}): the "
                f"object is missing, shorter than the node's file ({size} bytes), or not "
                "readable"
            ) from None
        at_local = 0
        for (at, n), want in zip(ranges, expected, strict=True):
            if got[at_local : at_local + n] != want:
                raise SourceFailed(
                    f"s3://{self._bucket}/{key}: bytes {at}-{at + n} differ from {path} (the "
                    "header or the data samples): the object is shorter than the node's file or "
                    "is not this checkpoint's file; upload the checkpoint's file again"
                )
            at_local += n


def object_ranges(
    entry: TensorEntry, at: int, nbytes: int, devices: dict[str, int]
) -> list[tuple[int, tuple[int, int, int]]]:
    """Where bytes `at`..`at + nbytes` of a tensor are: (offset in the window, (offset in the
    object, bytes, the object's device)) for each of its spans they overlap."""
    return [
        (into, (offset, n, devices[str(span.file)]))
        for span, offset, n, into in overlaps(entry, at, nbytes)
    ]


def _move(landing: Landing, windows: list[tuple[int, int, int]]) -> None:
    """Move each (slot, tensor, offset) of a request that completed."""
    for slot, index, at in windows:
        landing.landed(slot, index, at)


def _read_ranges(agent: Agent, ranges: list[tuple[int, int, int]], progress: FillProgress) -> bytes:
    """The (offset, bytes, device) ranges of OBJ objects, back to back; raises TransferFailed.

    They land in memory both processes map, a file of its own: a late write of a
    failed request can only land there, and ends with the transfer process.
    """
    total = sum(n for _, n, _ in ranges)
    fd = os.memfd_create("engramd-s3-read", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        (base,) = agent.attach([(fd, 0, total)], writable=True)
        scratch = Region(fd, 0, total)
    finally:
        os.close(fd)
    try:
        local, at = [], 0
        for _, n, _ in ranges:
            local.append((base + at, n, 0))
            at += n
        agent.read(
            local, ranges, "OBJ", agent.name, time.monotonic() + WINDOW_TIMEOUT_S, progress.cancel
        )
        return bytes(scratch.view())
    finally:
        scratch.close()


def _names(plan: TablePlan) -> dict[str, tuple[str, int]]:
    """Each file the plan reads (its real path; a plan from a store: its object's name) ->
    (its name in the checkpoint, its size)."""
    used = dict.fromkeys(str(span.file) for t in plan.tensors for span, _ in spans(t))
    if plan.store:
        return {name: (name, plan.objects[name]) for name in used}
    sizes = {s.path: s.size for s in plan.sources}
    files, _ = checkpoint_files(plan.checkpoint)
    named = {str(f.resolve()): f.name for f in files}
    return {path: (named.get(path, Path(path).name), sizes[path]) for path in used}
