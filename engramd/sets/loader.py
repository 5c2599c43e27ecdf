"""Copy a table set from its checkpoint into a backing: open, reserve, copy, describe, publish.

0. Identify: each checkpoint file's identity (device, inode, size, mtime,
   ctime) is compared with what the plan read, by path before the load, by
   descriptor before and after each tensor's copy (regular files only), and
   by path again at the end. A file rewritten or replaced during the load is
   never published.
1. Reserve: the backing reserves every byte first (`Backing.stage`, on
   several threads: engramd.host.reserve). A backing too small fails there,
   before a byte is copied, and a reserved page can never raise SIGBUS
   later in the daemon or in any worker. The pages are allocated here,
   under the NUMA placement (numa.py).
2. Copy: every tensor is cut into reads sized to the checkpoint's block
   device (`reads_for`: its largest request, in whole BUFFER_BYTES pieces),
   handed out in order (largest tensor first) to as many threads as keep
   the device's queue full (at least one per core, 4 to 32, unless
   --load-threads says), so one large tensor is read on every thread. A
   thread reads straight into the set's reserved pages through a writable
   mapping of them where they are huge pages (else into a buffer of its own
   and writes that with write(2): 4 KiB pages, which a mapping would fault
   and zero one by one; memory that is no file, cuMem; a disk's, whose I/O
   errors a mapping would turn into a SIGBUS) and digests each piece there,
   just read: the manifest's checksum is built from the digests of the
   pieces (engramd.checksum), so no thread waits for another's.
   Bytes not in the page cache are read O_DIRECT: the device writes the
   set's pages, with no page cache between and no copy (a fresh daemon's
   cold load went from 0.99 to 0.27 CPU-s/GiB, docs/performance.md), and
   the node never holds the tables twice. A safetensors tensor starts
   anywhere in its file (8 bytes of length, a JSON header of any length),
   so the set puts each tensor at its lead (layout.DIRECT_ALIGN): the same
   offset within a page as in the checkpoint. A read's whole pages then go
   straight into the set and the partial pages at its two ends through two
   pages of the thread's own. Bytes already cached (a checkpoint just
   written or read) are copied out of the page cache, faster than the
   device, and dropped from it behind the reads; so are a table's later
   row shards, whose offsets within a page differ from its first's, and
   files on a file system without O_DIRECT.
   The checkpoint is not mapped, so a file truncated under the daemon gives
   a short read (a clear error) instead of a SIGBUS. Measured by bench/
   (load, cold) against cp, the device and the loaders an operator would
   pick instead.
Fills (a FillSource, sets/seams.py; the fleet's in engramd/fleet): a `fill`
   given to `load_set` may write the reserved memory from elsewhere (a
   peer, an object store) and return the
   tensors' digests (checksums and strong digests) with the attestation they
   were checked against (kept in the manifest); then nothing is copied from
   the files (when it returns None, the copy runs as above).
3. Describe and publish: the backing makes the set visible only once its
   manifest is complete (tmpfs: manifest.json last, then a rename). A crash
   at any point leaves either no set or a complete one.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engramd.backings import Backing, StagedSet
from engramd.backings.regions import Region
from engramd.checksum import BUFFER_BYTES, combined, piece_digest
from engramd.host.blockdev import DeviceQueue, queue_of
from engramd.host.blocking import cores, map_on_threads
from engramd.host.numa import applied
from engramd.host.pagecache import resident_bytes
from engramd.sets.seams import Filled
from engramd.units import gib
from engramd.values import Placement
from engramd_shared.beneath import Opened
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import CheckpointError
from engramd_shared.fileid import SourceFile, open_regular
from engramd_shared.headers import TensorEntry
from engramd_shared.layout import DIRECT_ALIGN, Manifest, ManifestTensor

log = logging.getLogger("engramd")

DEFAULT_PLACEMENT = Placement()

#: Load threads with --load-threads 0 (as the device asks, at least one per core the
#: daemon may run on), within these. A thread spends most of a cold load blocked in the
#: kernel while the device reads, so even a small machine wants several reads in flight;
#: past 32 the copy out of the page cache, not the count of requests, is the limit.
MIN_THREADS, MAX_THREADS = 4, 32


class LoadCancelled(Exception):
    """The daemon stopped while the load was running."""


#: A load or fill logs a progress line whenever this share of its set more is in since its
#: last line, or PROGRESS_EVERY_S passed, whichever comes first...
PROGRESS_STEP = 0.10
PROGRESS_EVERY_S = 5.0
#: ...but none before this: a load done sooner is told by its start and ready lines.
PROGRESS_QUIET_S = 1.0


class LoadProgress:
    """Bytes copied so far; updated by the copy threads, read by the service.

    Named (`name`: the set's copy), it logs a progress line every few
    seconds or percent: bytes, share, source, rate, time left.
    """

    def __init__(self, total: int, name: str = "") -> None:
        self.total = total
        self.name = name
        self._done = 0
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.cancel = threading.Event()
        #: Where the bytes come from: "files", "peer HOST:PORT", "peers ...", "s3://bucket/prefix".
        self.source = "files"
        #: The bytes each of several sources gave (a fill from peers), by its name.
        self.by_source: dict[str, int] = {}
        #: When the last progress line was logged (None: none since the start), and its bytes.
        self._told: tuple[float | None, int] = (None, 0)

    @property
    def done(self) -> int:
        """Bytes copied so far."""
        return self._done

    def add(self, n: int, source: str = "") -> None:
        """Count `n` more bytes copied (from `source`, one of several); raise LoadCancelled if
        the load was cancelled."""
        now = time.monotonic()
        with self._lock:
            self._done += n
            if source:
                self.by_source[source] = self.by_source.get(source, 0) + n
            # Told under the lock: a thread that decided on its line and was then descheduled
            # must not log it after a later one.
            if self._due(now):
                log.info("%s", self.line(now))
        if self.cancel.is_set():
            raise LoadCancelled("the daemon is stopping")

    def _due(self, now: float) -> bool:
        """Whether a progress line is due now (it is then counted as told)."""
        when, told = self._told
        if when is None:
            when = self.started
        if not self.name or self._done >= self.total or now - self.started < PROGRESS_QUIET_S:
            return False
        if now - when < PROGRESS_EVERY_S and self._done - told < PROGRESS_STEP * self.total:
            return False
        self._told = (now, self._done)
        return True

    def rate(self, now: float | None = None) -> float:
        """Bytes a second since the load (or its last restart) started."""
        elapsed = (time.monotonic() if now is None else now) - self.started
        return self._done / elapsed if elapsed > 0 else 0.0

    def line(self, now: float | None = None) -> str:
        """The progress line: bytes, share, source, rate, time left."""
        rate = self.rate(now)
        left = f"{(self.total - self._done) / rate:.0f} s left" if rate else "time left unknown"
        return (
            f"set {self.name}: {gib(self._done)} of {gib(self.total)} "
            f"({100 * self._done // max(self.total, 1)}%) from {self.source}, "
            f"{rate / 1e9:.2f} GB/s, {left}"
        )

    def restart(self, source: str) -> None:
        """Count again from nothing: the bytes now come from `source`."""
        with self._lock:
            self._done = 0
            self.source = source
            self.by_source = {}
            self.started = time.monotonic()
            self._told = (None, 0)


#: Writes a staged set's memory from another source and returns its tensors'
#: digests and their attestation, or None: then the loader copies from the files.
Fill = Callable[[TablePlan, StagedSet, LoadProgress], Filled | None]


#: A read is whole pieces (the checksum's unit), and no longer than this: a longer one
#: holds its thread past the readahead that keeps the device busy.
MAX_READ_BYTES = 16 << 20
#: Requests of its largest size kept in flight per drive: the depth at which NVMe drives
#: reach their sequential rate (fio's usual 32), or the drive's own queue if shallower.
DRIVE_REQUESTS = 32


def copy_threads(asked: int) -> int:
    """The threads a load copies on where no device says more: `asked`, or with 0 one per
    core this process may run on, MIN_THREADS to MAX_THREADS."""
    if asked:
        return asked
    return max(MIN_THREADS, min(MAX_THREADS, cores()))


@dataclass(frozen=True)
class Reads:
    """How a load reads its checkpoint: bytes a read, reads in flight (its threads)."""

    size: int
    threads: int
    #: The block device they were sized to; "" where the files are on none (tmpfs, NFS).
    device: str = ""


def reads_for(plan: TablePlan, asked: int) -> Reads:
    """Reads sized to the deepest block device under the plan's files (`sized_reads`)."""
    queues = [q for q in map(queue_of, {s.dev for s in plan.sources}) if q is not None]
    deepest = max(
        queues,
        key=lambda q: (q.depth or DRIVE_REQUESTS * q.members) * q.max_request,
        default=None,
    )
    return sized_reads(deepest, asked)


def sized_reads(queue: DeviceQueue | None, asked: int) -> Reads:
    """Reads sized to `queue`: `asked` threads (--load-threads), or with 0 from the device.

    A read asks for the device's largest request (max_sectors_kb, in whole
    pieces, at most MAX_READ_BYTES), and enough reads are in flight to keep
    DRIVE_REQUESTS of its requests queued on each drive (md and dm members
    counted), within its own queue. A cold load's reads are direct, so a
    reader has no readahead in flight: it keeps read / max_request requests
    queued. Never fewer threads than cores, since each also digests (and
    copies, where it reads through the page cache). No device (tmpfs, NFS):
    a piece a read, a thread a core.
    """
    if queue is None:
        return Reads(BUFFER_BYTES, copy_threads(asked))
    pieces = max(1, -(-queue.max_request // BUFFER_BYTES))
    size = min(MAX_READ_BYTES, pieces * BUFFER_BYTES)
    requests = DRIVE_REQUESTS * queue.members
    if queue.depth:
        requests = min(requests, queue.depth)
    per_reader = max(1, size // max(queue.max_request, 1))
    depth = -(-requests // per_reader)
    threads = asked or max(MIN_THREADS, min(MAX_THREADS, max(cores(), depth)))
    return Reads(size, threads, queue.name)


def load_set(
    plan: TablePlan,
    backing: Backing,
    threads: int,
    progress: LoadProgress,
    placement: Placement = DEFAULT_PLACEMENT,
    node: int | None = None,
    fill: Fill | None = None,
) -> Manifest:
    """Copy the plan's tensors into `backing`, publish the set and return its manifest.

    `threads` is --load-threads: 0 sizes them to the device (`reads_for`).
    The backing reserves (allocates) every page under `placement`; a copy
    kept for NUMA `node` (--numa per-node) is bound there.
    """
    sources = {s.path: s for s in plan.sources}
    for source in plan.sources:
        _check_identity(source, _stat(plan, source), "since its headers were read")
    with applied(placement.for_copy(node)):
        staged = backing.stage(plan, node)
    try:
        filled = fill(plan, staged, progress) if fill is not None else None
        # A filled set has nothing left to copy from the files.
        order = (
            []
            if filled is not None
            else sorted(range(len(plan.tensors)), key=lambda i: -plan.tensors[i].nbytes)
        )
        copies: dict[int, _TensorCopy] = {}
        buffers = threading.local()
        reads = reads_for(plan, threads)
        if order:
            log.info(
                "set %s: reads of %d MiB, %d in flight (%s)",
                plan.set_id,
                reads.size >> 20,
                reads.threads,
                f"sized to {reads.device}" if reads.device else "on no block device",
            )

        def copy(piece: tuple[_TensorCopy, int]) -> None:
            if not hasattr(buffers, "buffer"):
                # Anonymous mappings: page-aligned, as direct reads want them.
                buffers.buffer = memoryview(mmap.mmap(-1, reads.size + DIRECT_ALIGN))
                buffers.edges = memoryview(mmap.mmap(-1, 2 * DIRECT_ALIGN))
            progress.add(piece[0].copy(piece[1], buffers.buffer, buffers.edges))

        try:
            for i in order:
                copies[i] = _TensorCopy(plan.tensors[i], sources, staged, i, plan.held, reads.size)
            pieces = [(copies[i], at) for i in order for at in copies[i].reads()]
            map_on_threads(copy, pieces, reads.threads, "load")
            if order:
                direct = sum(c.direct for c in copies.values())
                log.info(
                    "set %s: %s read direct into its pages, %s through the page cache",
                    plan.set_id,
                    gib(direct),
                    gib(plan.nbytes - direct),
                )
        except BaseException:
            for c in copies.values():
                c.fail()
            raise
        finally:
            for c in copies.values():
                c.close()
        sums = (
            filled.digests
            if filled is not None
            else [copies[i].checksum() for i in range(len(plan.tensors))]
        )
        for source in plan.sources:
            _check_identity(source, _stat(plan, source), "during the load (replaced)")
        manifest = Manifest(
            set_id=plan.set_id,
            fingerprint=plan.fingerprint,
            nonce=secrets.token_hex(16),
            checkpoint=plan.where,
            selection=plan.selection,
            created=time.time(),
            tensors=tuple(
                ManifestTensor(
                    name=t.name,
                    dtype=t.dtype,
                    shape=t.shape,
                    file=staged.placement(i)[0],
                    offset=staged.placement(i)[1],
                    nbytes=t.nbytes,
                    checksum=sums[i],
                    parts=tuple(p.name for p in t.parts),
                    part_rows=tuple(p.shape[0] for p in t.parts),
                )
                for i, t in enumerate(plan.tensors)
            ),
            sources=plan.sources,
            node=node,
            attestation=filled.attestation if filled is not None else None,
            strong_digests=tuple(filled.strong) if filled is not None else None,
        )
        staged.publish(manifest)
        return manifest
    except BaseException:
        staged.discard()
        raise


def _stat(plan: TablePlan, source: SourceFile) -> os.stat_result:
    # A file the plan holds open (a worker's, opened beneath its root) is the
    # one read: its name may lead elsewhere by now, and is never followed again.
    held = plan.held.get(source.path)
    return held.file.stat() if held is not None else os.stat(source.path)


def _check_identity(source: SourceFile, st: os.stat_result, when: str) -> None:
    now = SourceFile.of(source.path, st)
    if now != source:
        raise CheckpointError(
            f"{source.path} changed {when} (size {source.size} -> {now.size}, inode "
            f"{source.ino} -> {now.ino}, mtime_ns {source.mtime_ns} -> {now.mtime_ns}); "
            "engramd never serves a copy of a file that changed under it: load it again "
            "once the file is final"
        )


class _TensorCopy:
    """One tensor's copy, read by read on several threads, each read's pieces digested by
    its thread.

    A table joined from row shards reads its shards back to back: a piece
    may end one shard and start the next.
    """

    def __init__(
        self,
        entry: TensorEntry,
        sources: dict[str, SourceFile],
        staged: StagedSet,
        index: int,
        held: Mapping[str, Opened],
        read_bytes: int,
    ):
        self._entry = entry
        self._read_bytes = read_bytes
        self._spans = [
            _Span(p, sources[str(p.file)], at, held.get(str(p.file)))
            for p, at in _starts(entry.spans)
        ]
        self._starts = [span.start for span in self._spans]
        self._staged = staged
        self._index = index
        self._region = _mapped(staged, index, entry.nbytes)
        self._view = self._region.view() if self._region is not None else None
        self._lock = threading.Lock()
        self._digests: list[bytes | None] = [None] * -(-entry.nbytes // BUFFER_BYTES)
        self._failed = False
        #: Bytes read direct (the rest went through the page cache).
        self.direct = 0

    def reads(self) -> range:
        """Offsets of the tensor's reads, in order (each a whole number of pieces)."""
        return range(0, self._entry.nbytes, self._read_bytes)

    def copy(self, at: int, buffer: memoryview, edges: memoryview) -> int:
        """Read the bytes at `at` (one read), digest and write each of their pieces; their
        size in bytes.

        Where the backing's memory is a file they are read straight into the set's
        reserved pages and digested there; else through `buffer` (at the file's offset
        within a page, for a direct read), then written. `edges`: two pages for the
        partial pages at either end of a direct read.
        """
        entry = self._entry
        n = min(self._read_bytes, entry.nbytes - at)
        first = bisect.bisect_right(self._starts, at) - 1
        if self._view is not None:
            data = self._view[at : at + n]
        else:
            shift = _within(self._spans[first].position(at))
            data = buffer[shift : shift + n]
        for span in itertools.takewhile(lambda s: s.start < at + n, self._spans[first:]):
            begin, end = max(at, span.start), min(at + n, span.start + span.entry.nbytes)
            with self._lock:
                span.open()
            direct = span.read(data[begin - at : end - at], begin - span.start, edges)
            with self._lock:
                span.count(end - begin)
                self.direct += (end - begin) * direct
        for piece in range(0, n, BUFFER_BYTES):
            part = data[piece : piece + BUFFER_BYTES]
            self._digests[(at + piece) // BUFFER_BYTES] = piece_digest(part)
            if self._view is None:
                self._staged.write(self._index, part, at + piece)
        return n

    def fail(self) -> None:
        """A piece of the load failed: the source files are not checked at close."""
        self._failed = True

    def close(self) -> None:
        """Check the source files are still the ones planned, close their descriptors and
        unmap the set's pages (a memfd with a writable mapping cannot be sealed)."""
        try:
            for span in self._spans:
                span.close(check=not self._failed)
        finally:
            for span in self._spans:
                span.close(check=False)
            self._view = None
            if self._region is not None:
                self._region.close()

    def checksum(self) -> str:
        """The manifest's digest of the whole tensor (every piece copied)."""
        digests = [d for d in self._digests if d is not None]
        assert len(digests) == len(self._digests)
        return combined(digests)


def _mapped(staged: StagedSet, index: int, nbytes: int) -> Region | None:
    """The index-th tensor's reserved pages mapped writable where they are huge pages, or
    None: 4 KiB pages, a backing that maps none (cuMem, a disk's), an empty tensor.

    On huge pages a read lands in the set's own pages: no copy through a buffer and a
    write(2) (from the page cache 4.4-4.8 GB/s against 0.8-2.0, bench/load.py; cold, the
    device writes them). On 4 KiB pages a mapping costs a fault a page, which zeroes it
    for nothing, and the unmapping of every page at the end, where write(2) fills a
    reserved page without zeroing it: a fresh daemon's cold load read 1.71 GB/s through
    its buffers against 1.42 through a mapping (docs/performance.md). The pages are
    reserved already, so no store here can fault for want of memory.
    """
    if nbytes == 0:
        return None
    try:
        fd, offset = staged.memory(index)
    except NotImplementedError:
        return None
    if os.fstat(fd).st_blksize <= mmap.PAGESIZE:
        return None
    # Not populated: the copy threads fault their own pieces in, on every thread.
    return Region(fd, offset, nbytes, writable=True, populate=False)


def _starts(spans: tuple[TensorEntry, ...]) -> list[tuple[TensorEntry, int]]:
    """Each span with the offset of its first byte in the tensor."""
    starts, at = [], 0
    for span in spans:
        starts.append((span, at))
        at += span.nbytes
    return starts


class _Span:
    """The bytes of one checkpoint tensor in the tensor being copied, and its descriptor."""

    def __init__(
        self, entry: TensorEntry, source: SourceFile, start: int, held: Opened | None
    ) -> None:
        self.entry = entry
        self.source = source
        #: The file as the plan opened it, if it holds it (read that, never the path).
        self.held = held
        #: Offset of the span's first byte in the tensor.
        self.start = start
        #: Bytes of the span read so far.
        self.done = 0
        self.fd = -1
        #: The same file opened O_DIRECT; -1 where its file system takes no direct reads.
        self.direct = -1
        #: Set once a direct read was refused (a logical block larger than DIRECT_ALIGN):
        #: the rest is read buffered. The descriptor stays open until the span's last read,
        #: as other threads may be reading through it.
        self.refused = False

    def position(self, at: int) -> int:
        """The file offset of the tensor's byte `at` (within this span)."""
        return self.entry.offset + at - self.start

    def open(self) -> None:
        """Open the span's file, once (under the tensor's lock)."""
        # A descriptor of its own per tensor: the kernel keeps readahead state
        # per open file, and threads streaming one shared descriptor at
        # distant offsets (two tensors of a file) defeat it (measured: cold
        # loads at half the speed).
        if self.fd >= 0:
            return
        entry = self.entry
        self.fd = self.held.reopen() if self.held is not None else open_regular(entry.file)
        _check_identity(self.source, os.fstat(self.fd), "during the load")
        os.posix_fadvise(self.fd, entry.offset, entry.nbytes, os.POSIX_FADV_SEQUENTIAL)
        try:
            # The very file open (its magic link), never its name again.
            self.direct = os.open(
                f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC
            )
        except OSError:
            # A file system without direct reads (EINVAL: ramfs, tmpfs before 6.6), or no
            # /proc: the span is read buffered.
            self.direct = -1

    def read(self, data: memoryview, at: int, edges: memoryview) -> bool:
        """Fill `data` from the span's byte `at` on: directly where the bytes are not in the
        page cache and `data` shares the file's offset within a page, else buffered; whether
        directly.

        A direct read is the device writing the set's pages: no page cache, no copy. Where
        the file is cached (written a moment ago, read before) a copy out of the page cache
        is faster than the device.
        """
        start = self.entry.offset + at
        if (
            self.direct >= 0
            and not self.refused
            and _within(_address(data)) == _within(start)
            and resident_bytes(self.fd, start, len(data)) * 2 < len(data)
            and self._read_direct(data, start, edges)
        ):
            return True
        self._read_buffered(data, at)
        return False

    def _read_direct(self, data: memoryview, start: int, edges: memoryview) -> bool:
        """Read `data`'s bytes at file offset `start` with O_DIRECT: whole pages straight
        into `data`, the partial pages at either end into `edges` and copied from there;
        False on a short read (the buffered read then tells why)."""
        end = start + len(data)
        first, last = start - _within(start), -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
        head = min(last, -(-start // DIRECT_ALIGN) * DIRECT_ALIGN)  # the first whole page
        tail = max(head, end - _within(end))  # the partial page at the end
        parts = []
        if head > first:
            parts.append(edges[:DIRECT_ALIGN])
        if tail > head:
            parts.append(data[head - start : tail - start])
        if last > tail:
            parts.append(edges[DIRECT_ALIGN:])
        try:
            got = os.preadv(self.direct, parts, first)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # A logical block larger than DIRECT_ALIGN: this file is read buffered.
            self.refused = True
            return False
        if got < end - first:
            return False
        if head > first:
            data[: min(head, end) - start] = edges[start - first : min(head, end) - first]
        if last > tail:
            data[tail - start :] = edges[DIRECT_ALIGN : DIRECT_ALIGN + end - tail]
        return True

    def _read_buffered(self, data: memoryview, at: int) -> None:
        """Fill `data` from the span's byte `at` on, and drop what it read from the page cache.

        The bytes now live in the set: dropped behind the reads, the node holds one copy
        of the tables, not a second in the page cache, and the next reads take pages the
        kernel freed just now rather than memory it has not touched for a while (measured
        in docs/performance.md: a fresh daemon's cold load 0.61x -> 0.86x the device).
        The kernel drops only whole folios within the range (clean ones: a file still
        being written back keeps its pages); those across two reads go at the span's end.
        """
        done = 0
        while done < len(data):
            n = os.preadv(self.fd, [data[done:]], self.entry.offset + at + done)
            if n == 0:
                raise CheckpointError(
                    f"{self.entry.file}: tensor {self.entry.name!r}: the file ended while it "
                    "was being loaded (truncated or rewritten); fetch the file again"
                )
            done += n
        os.posix_fadvise(self.fd, self.entry.offset + at, len(data), os.POSIX_FADV_DONTNEED)

    def count(self, n: int) -> None:
        """Count `n` bytes read; once all are, check the file and close it.

        A table of many shards would otherwise hold a descriptor per shard
        until its last piece is copied.
        """
        self.done += n
        if self.done == self.entry.nbytes:
            os.posix_fadvise(self.fd, self.entry.offset, self.entry.nbytes, os.POSIX_FADV_DONTNEED)
            self.close(check=True)

    def close(self, check: bool) -> None:
        """Close the descriptor; with `check`, first check the file is still the one planned."""
        if self.fd < 0:
            return
        try:
            if check:
                _check_identity(self.source, os.fstat(self.fd), "during the load")
        finally:
            os.close(self.fd)
            self.fd = -1
            if self.direct >= 0:
                os.close(self.direct)
                self.direct = -1


def _within(at: int) -> int:
    """`at` (a file offset, an address) within its DIRECT_ALIGN page."""
    return at % DIRECT_ALIGN


def _address(data: memoryview) -> int:
    """Where `data` starts in this process's memory (a writable buffer)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(data))
