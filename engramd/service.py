"""engramd.v1.TableService: attach (a lease held by an open stream) and status."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from engramd_client.checkpoint import TablePlan, is_set_id, plan_tables
from engramd_client.errors import CAUSES
from engramd_client.layout import set_dir
from engramd_client.pb import engramd_pb2 as pb
from engramd_client.pb import engramd_pb2_grpc as pb_grpc

from . import __version__
from .blocking import BlockingPool
from .config import DaemonConfig
from .errors import (
    FingerprintDiffers,
    InvalidRequest,
    NotAllowed,
    SelectionRefused,
    UnknownSet,
    abort,
)
from .shmfs import gib, huge_pages, mount_id, usage
from .store import STATUS_LEASES, Lease, SetStore, TableSet

log = logging.getLogger("engramd")

#: How often a worker waiting for a load hears about its progress.
PROGRESS_INTERVAL_S = 0.25

# Kubernetes' label rules: a worker's labels stay small and print safely.
_MAX_LABELS = 16
_LABEL_KEY = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9._-]{0,63}$")
_MAX_PATH = 4096
_NONCE = re.compile(r"^([0-9a-f]{32})?$")
# Reads of workers' checkpoints (headers, samples) at once; they may hang on a
# network mount, so they never share threads with the daemon's own work.
_CHECKPOINT_READERS = 8


class TableService(pb_grpc.TableServiceServicer):
    """Serves attaches and status from a SetStore."""

    def __init__(self, config: DaemonConfig, store: SetStore) -> None:
        self._config = config
        self._store = store
        self._started = time.monotonic()
        self._allowed = [Path(p).resolve() for p in config.allow_roots]
        self._configured = {str(Path(p).resolve()) for p in config.checkpoints}
        self._huge_pages = huge_pages(store.shm_dir)
        self._readers = BlockingPool("checkpoint", _CHECKPOINT_READERS)
        #: Every configured set is ready (the health service says SERVING).
        self.ready = False

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttachEvent]:
        """Wait for the set to be ready, hand out its handles, hold the lease."""
        try:
            _validate(request)
            ts = await self._resolve(request)
            async for progress in load_progress(ts):
                yield pb.AttachEvent(progress=progress)
            if ts.error is not None:
                raise ts.error
            lease = self._store.add_lease(ts, request)
        except Exception as e:
            self._store.attaches["error"] += 1
            await abort(context, e)
            return
        self._store.attaches["ok"] += 1
        try:
            yield pb.AttachEvent(attached=self._attachment(ts, lease))
            await lease.ended.wait()
            if lease.draining:
                yield pb.AttachEvent(draining=pb.Draining())
        finally:
            self._store.end_lease(lease)

    async def _resolve(self, request: pb.AttachRequest) -> TableSet:
        ts = self._store.get(request.set_id)
        if ts is not None and ts.state != "failed":
            return ts
        if request.reattach or not request.checkpoint:
            if ts is not None and ts.error is not None:
                raise ts.error
            raise UnknownSet(
                f"engramd holds no set {request.set_id}; attach with the checkpoint folder, "
                "or have the daemon load it at start (--checkpoint)"
            )
        if request.tensors and request.tensors != self._config.tensors:
            raise SelectionRefused(
                f"engramd loads for workers only its configured selection {self._config.tensors!r}"
                f", not {request.tensors!r}; attach with that selection, or have the operator "
                "load this one (engramd load --tensors)"
            )
        path = _resolve(request.checkpoint)
        self._check_unchanged(path)
        self._check_allowed(path)
        plan = await self._readers.run(plan_tables, path, self._config.tensors)
        self._check_files(path, plan)
        if plan.set_id != request.set_id:
            # No set id here: a caller must not learn the id of files it cannot read.
            raise FingerprintDiffers(
                f"the daemon's copy of {path} differs from the worker's: the files' names, "
                "sizes, headers or data differ; give the daemon and the worker the same checkpoint"
            )
        return await self._store.ensure(plan)

    def _check_unchanged(self, path: Path) -> None:
        # The worker's files are not the ones the daemon loaded from this
        # path: the checkpoint changed on disk (or the worker sees other
        # files there). Never hand out the old bytes; load the new ones only
        # where workers may trigger loads.
        if any(path.is_relative_to(r) for r in self._allowed):
            return
        for ts in self._store.sets.values():
            if ts.checkpoint == str(path) and ts.state != "failed":
                raise FingerprintDiffers(
                    f"the checkpoint at {path} is not the one engramd loaded from there: it "
                    f"changed on disk, or the worker sees other files there; `engramd load "
                    f"{path}` loads the new version, or give the daemon and the worker the "
                    "same files"
                )

    def _check_allowed(self, path: Path) -> None:
        if str(path) in self._configured or any(path.is_relative_to(r) for r in self._allowed):
            return
        roots = ", ".join(map(str, self._allowed)) or "none"
        raise NotAllowed(
            f"engramd may not load {path} for a worker (allowed roots: {roots}); start the "
            f"daemon with --checkpoint {path} or --allow-root <dir>"
        )

    def _check_files(self, path: Path, plan: TablePlan) -> None:
        # Every file, not just the folder: a shard that is a symlink to
        # another user's checkpoint resolves outside the root. resolve()
        # undoes symlinks and "..", not bind mounts: a file bound into the
        # root from elsewhere has the root's path but another mount.
        if str(path) in self._configured:
            return
        root = next(r for r in self._allowed if path.is_relative_to(r))
        allowed = mount_id(root)
        for f in {t.file for t in plan.tensors}:
            if not f.is_relative_to(root):
                raise NotAllowed(
                    f"{path}: a file of this checkpoint resolves outside the allowed root "
                    f"{root} (a symlink?); engramd loads for workers only files inside the root"
                )
            if mount_id(f) != allowed:
                raise NotAllowed(
                    f"{f} is on another mount than the allowed root {root} (a bind mount?); "
                    "engramd loads for workers only files on the root's own mount"
                )

    def _attachment(self, ts: TableSet, lease: Lease) -> pb.Attachment:
        assert ts.manifest is not None
        folder = set_dir(self._store.shm_dir, ts.set_id)
        return pb.Attachment(
            set_id=ts.set_id,
            fingerprint=ts.fingerprint,
            nonce=ts.manifest.nonce,
            lease_id=lease.lease_id,
            shm_dir=self._store.shm_dir,
            set_dir=str(folder),
            sources=[
                pb.SourceFile(
                    path=f.path,
                    dev=f.dev,
                    ino=f.ino,
                    size=f.size,
                    mtime_ns=f.mtime_ns,
                    ctime_ns=f.ctime_ns,
                )
                for f in ts.manifest.sources
            ],
            tensors=[
                pb.TensorHandle(
                    name=t.name,
                    dtype=t.dtype,
                    shape=t.shape,
                    kind=pb.HANDLE_KIND_SHM,
                    shm=pb.ShmHandle(path=str(folder / t.file), offset=t.offset, length=t.nbytes),
                )
                for t in ts.manifest.tensors
            ],
        )

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """What the node holds."""
        try:
            return self.status()
        except Exception as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e

    async def ReportFallback(
        self, request: pb.FallbackReport, context: grpc.aio.ServicerContext
    ) -> pb.FallbackAck:
        """Count a worker's fallback to private tables by cause (known causes only)."""
        if request.cause not in CAUSES or not (request.set_id == "" or is_set_id(request.set_id)):
            await abort(
                context,
                InvalidRequest(
                    f"cause must be one of {', '.join(sorted(CAUSES))} and set_id a set id"
                ),
            )
        self._store.fallbacks[request.cause] = self._store.fallbacks.get(request.cause, 0) + 1
        log.info(
            "pid %d fell back to private tables (%s, set %s, %s)",
            request.pid,
            request.cause,
            request.set_id,
            gib(request.bytes),
        )
        return pb.FallbackAck()

    def status(self) -> pb.StatusReply:
        """The status reply, built from the store."""
        u = usage(self._store.shm_dir)
        now = time.monotonic()
        return pb.StatusReply(
            daemon=pb.DaemonInfo(
                version=__version__,
                pid=os.getpid(),
                uptime_s=now - self._started,
                socket=self._config.socket,
                ready=self.ready,
            ),
            shm=pb.ShmInfo(
                dir=u.dir,
                total_bytes=u.total,
                used_bytes=u.used,
                free_bytes=u.free,
                huge_pages=self._huge_pages,
            ),
            sets=[set_info(ts, now) for ts in self._store.sets.values()],
        )


async def load_progress(ts: TableSet) -> AsyncIterator[pb.LoadProgress]:
    """The set's load progress, four times a second, until the load ends (ready or failed)."""
    while not ts.done.is_set():
        yield pb.LoadProgress(bytes_done=ts.bytes_loaded, bytes_total=ts.nbytes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ts.done.wait(), PROGRESS_INTERVAL_S)


def set_info(ts: TableSet, now: float | None = None) -> pb.SetInfo:
    """The wire view of a set."""
    now = time.monotonic() if now is None else now
    return pb.SetInfo(
        set_id=ts.set_id,
        checkpoint=ts.checkpoint,
        fingerprint=ts.fingerprint,
        bytes=ts.nbytes,
        backing="shm",
        state=ts.state,
        bytes_loaded=ts.bytes_loaded,
        adopted=ts.adopted,
        locked=ts.locked,
        error=str(ts.error) if ts.error else "",
        tensors=ts.ntensors,
        load_seconds=ts.load_seconds,
        leases=[
            pb.LeaseInfo(
                lease_id=lease.lease_id,
                pid=lease.pid,
                labels=lease.labels,
                attached_s=now - lease.started,
                stale=lease.stale,
                pid_verified=lease.pid_start is not None,
            )
            for lease in itertools.islice(ts.leases.values(), STATUS_LEASES)
        ],
        lease_count=len(ts.leases),
    )


def _resolve(checkpoint: str) -> Path:
    try:
        return Path(checkpoint).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise InvalidRequest(f"checkpoint {checkpoint!r} cannot be resolved ({e})") from None


def _validate(request: pb.AttachRequest) -> None:
    if not is_set_id(request.set_id):
        raise InvalidRequest(f"set_id {request.set_id[:64]!r} is not a set id (20 hex digits)")
    if len(request.checkpoint) > _MAX_PATH or len(request.tensors) > _MAX_PATH:
        raise InvalidRequest("checkpoint or tensors is longer than 4096 characters")
    if "\0" in request.checkpoint or "\0" in request.tensors:
        raise InvalidRequest("checkpoint or tensors holds a NUL character")
    if request.pid < 0:
        raise InvalidRequest(f"pid {request.pid} is negative")
    if not _NONCE.match(request.nonce):
        raise InvalidRequest("nonce is not 32 hex digits")
    if len(request.labels) > _MAX_LABELS or not all(
        _LABEL_KEY.match(k) and _LABEL_VALUE.match(v) for k, v in request.labels.items()
    ):
        raise InvalidRequest(
            f"labels: at most {_MAX_LABELS}, keys of 1 to 63 and values of up to 63 characters "
            "of A-Z a-z 0-9 . _ - (Kubernetes' label rules)"
        )
    if request.accept and pb.HANDLE_KIND_SHM not in request.accept:
        raise InvalidRequest(
            "this daemon hands out shm handles (HANDLE_KIND_SHM); the request accepts none"
        )
