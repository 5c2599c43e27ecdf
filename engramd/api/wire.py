"""The sets' values as engramd.v1 messages: sets, leases, progress, status.

The other direction, requests as the sets' values, is requests.py's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from engramd import __version__
from engramd.backings import Backing, Usage
from engramd.backings.handles import CuMemRange, FileRange, Handle, HandleKind, PathRange
from engramd.sets.fallbacks import Fallback
from engramd.sets.intents import GpuRoute, Progress
from engramd.sets.leases import STATUS_LEASES, Lease, LeaseBook
from engramd.sets.store import SetStore
from engramd.sets.tableset import SetState, TableSet
from engramd.sets.warming import cached_bytes
from engramd_shared.families import family_of_selection
from engramd_shared.layout import Manifest, ManifestTensor
from engramd_shared.pb import engramd_pb2 as pb

#: Each handle kind as the wire numbers it.
WIRE_KINDS: dict[HandleKind, int] = {
    HandleKind.SHM: pb.HANDLE_KIND_SHM,
    HandleKind.FD: pb.HANDLE_KIND_FD,
    HandleKind.CUMEM: pb.HANDLE_KIND_CUMEM,
    HandleKind.CUMEM_FABRIC: pb.HANDLE_KIND_CUMEM_FABRIC,
}
#: Each GPU route as the wire numbers it (by name: a route the wire lacks fails at import).
WIRE_ROUTES: dict[GpuRoute, int] = {
    route: pb.GpuRoute.Value(f"GPU_ROUTE_{route.name}") for route in GpuRoute
}


def progress(step: Progress) -> pb.LoadProgress:
    """Bytes of a load or a proof done so far."""
    return pb.LoadProgress(bytes_done=step.done, bytes_total=step.total)


def source_files(manifest: Manifest) -> list[pb.SourceFile]:
    """The checkpoint files a set was loaded from, as they were then."""
    return [
        pb.SourceFile(
            path=f.path,
            dev=f.dev,
            ino=f.ino,
            size=f.size,
            mtime_ns=f.mtime_ns,
            ctime_ns=f.ctime_ns,
        )
        for f in manifest.sources
    ]


def tensor_handle(handle: Handle, entry: ManifestTensor | None = None) -> pb.TensorHandle:
    """A backing's description of a tensor's bytes as the wire's handle (its kind from its form),
    with the checkpoint tensors it is made of and their rows (`entry`'s, where not itself
    alone)."""
    out = pb.TensorHandle(name=handle.name, dtype=handle.dtype, shape=handle.shape)
    if entry is not None:
        out.parts.extend(entry.parts)
        out.part_rows.extend(entry.part_rows)
    where = handle.where
    if isinstance(where, PathRange):
        out.kind = pb.HANDLE_KIND_SHM
        out.shm.CopyFrom(
            pb.ShmHandle(
                path=where.path, offset=where.offset, length=where.length, set_dir=where.set_dir
            )
        )
    elif isinstance(where, FileRange):
        out.kind = pb.HANDLE_KIND_FD
        out.fd.CopyFrom(pb.FdHandle(file=where.file, offset=where.offset, length=where.length))
    else:
        out.kind = pb.HANDLE_KIND_CUMEM_FABRIC if where.fabric else pb.HANDLE_KIND_CUMEM
        out.cumem.CopyFrom(_cumem(where))
    return out


def _cumem(where: CuMemRange) -> pb.CuMemHandle:
    out = pb.CuMemHandle(
        file=where.file,
        fabric=where.fabric,
        size=where.size,
        offset=where.offset,
        length=where.length,
    )
    if where.host_numa is not None:
        out.host_numa = where.host_numa
    else:
        out.device_uuid = where.device_uuid
    return out


def attachment(
    ts: TableSet, lease: Lease, handles: list[Handle], fd_socket: str | None, sources: bool = True
) -> pb.Attachment:
    """The answer to an attach: the set, the lease, its handles, and the fd channel (if used);
    the checkpoint files it was loaded from only with `sources`."""
    assert ts.manifest is not None
    entries = {t.name: t for t in ts.manifest.tensors}
    out = pb.Attachment(
        set_id=ts.set_id,
        fingerprint=ts.fingerprint,
        nonce=ts.manifest.nonce,
        lease_id=lease.lease_id,
        sources=source_files(ts.manifest) if sources else [],
        tensors=[tensor_handle(h, entries.get(h.name)) for h in handles],
        gpu_route=WIRE_ROUTES[lease.gpu_route],  # type: ignore[arg-type]
    )
    if fd_socket is not None:
        out.fd_channel.socket = fd_socket
        out.fd_channel.secret = lease.fd_secret
    return out


def _load_seconds(ts: TableSet, now: float) -> float:
    """How long the set's load took, or, while it loads, has run so far (status's rate and
    time left)."""
    if ts.state is SetState.LOADING and ts.progress is not None:
        return max(now - ts.progress.started, 0.0)
    return ts.load_seconds


def own_usage(store: SetStore, backing: Backing) -> Usage:
    """`backing`'s usage with `used` the bytes of this daemon's own sets in it (a file
    system's own count holds other daemons' sets and unrelated files)."""
    u = backing.usage()
    own = sum(ts.nbytes for ts in store.held() if ts.backing is backing)
    return dataclasses.replace(u, used=own)


def _marked(info: pb.SetInfo, configured: set[str] | None) -> pb.SetInfo:
    info.unconfigured = configured is not None and info.set_id not in configured
    return info


def fallback_info(f: Fallback, now: float) -> pb.FallbackInfo:
    """A replica holding private tables, as the wire says it."""
    r = f.record
    return pb.FallbackInfo(
        pid=r.pid,
        uid=f.uid,
        pid_verified=f.pid_verified,
        set_id=r.set_id,
        checkpoint=r.checkpoint,
        cause=r.cause,
        reason=r.reason,
        bytes=max(r.nbytes, 0),
        since_s=max(now - r.since, 0.0),
        labels=r.labels,
    )


def set_info(ts: TableSet, now: float | None = None) -> pb.SetInfo:
    """A set and (at most STATUS_LEASES of) its leases."""
    now = time.monotonic() if now is None else now
    return pb.SetInfo(
        set_id=ts.set_id,
        checkpoint=ts.checkpoint,
        fingerprint=ts.fingerprint,
        bytes=ts.nbytes,
        backing=ts.backing.name,
        state=ts.state.value,
        bytes_loaded=ts.bytes_loaded,
        adopted=ts.adopted,
        published=ts.published,
        locked=ts.locked,
        error=str(ts.error) if ts.error else "",
        tensors=ts.ntensors,
        load_seconds=_load_seconds(ts, now),
        source=ts.source,
        bytes_by_source=ts.bytes_by_source,
        leases=[
            pb.LeaseInfo(
                lease_id=lease.lease_id,
                pid=lease.pid,
                labels=lease.labels,
                attached_s=now - lease.started,
                stale=lease.stale,
                pid_verified=lease.pid_verified,
                kind=WIRE_KINDS[lease.kind],  # type: ignore[arg-type]
                device=lease.device,
                gpu_route=WIRE_ROUTES[lease.gpu_route],  # type: ignore[arg-type]
                uid=lease.uid,
            )
            for lease in LeaseBook.listed(ts, STATUS_LEASES)
        ],
        lease_count=LeaseBook.count(ts),
        page_size=ts.backing.page_size if ts.pages is None else ts.pages.page_size,
        bytes_per_node=ts.nodes,
        numa_node=ts.node,
        huge_page_bytes=None if ts.pages is None else ts.pages.huge_bytes,
        family=family.name if (family := family_of_selection(ts.selection)) else "",
        changed_tensors=ts.changed,
        resident_bytes=cached_bytes(ts),
        page_cache_warming=ts.warming,
        generation=ts.generation,
        replaced_by=ts.replaced_by,
    )


def _withheld(ts: TableSet) -> pb.SetInfo:
    """A set as a caller that may not learn its id or checkpoint sees it: size and state."""
    return pb.SetInfo(
        bytes=ts.nbytes,
        backing=ts.backing.name,
        state=ts.state.value,
        bytes_loaded=ts.bytes_loaded,
        tensors=ts.ntensors,
        lease_count=LeaseBook.count(ts),
        page_size=ts.backing.page_size,
    )


def status_reply(
    store: SetStore,
    socket: str,
    uptime_s: float,
    ready: bool,
    writable_gpu_mappings: bool = False,
    shown: Callable[[TableSet], bool] | None = None,
    worker_share_per_uid: float = 0.0,
    worker_set_grace_s: float = 0.0,
    failed_checkpoints: list[tuple[str, str]] | None = None,
    fallbacks: list[Fallback] | None = None,
    configured: set[str] | None = None,
) -> pb.StatusReply:
    """What the node holds; sets that `shown` refuses are listed without id, path or leases.

    `failed_checkpoints`: (checkpoint, why) of each configured checkpoint with no ready set.
    `fallbacks`: the replicas holding private tables. `configured`: the set ids configured
    checkpoints name (None: every set counts as configured).
    """
    usages = [(b, own_usage(store, b)) for b in store.backings]
    u = usages[0][1]
    now = time.monotonic()
    wall = time.time()
    return pb.StatusReply(
        daemon=pb.DaemonInfo(
            version=__version__,
            pid=os.getpid(),
            uptime_s=uptime_s,
            socket=socket,
            ready=ready,
            writable_gpu_mappings=writable_gpu_mappings,
            worker_share_per_uid=worker_share_per_uid,
            worker_set_grace_s=worker_set_grace_s,
            failed_checkpoints=[
                pb.FailedCheckpoint(checkpoint=c, error=e) for c, e in failed_checkpoints or ()
            ],
        ),
        shm=pb.ShmInfo(
            dir=u.where,
            total_bytes=u.total,
            used_bytes=u.used,
            free_bytes=u.free,
            huge_pages=u.page_size > 4096,
            page_size=u.page_size,
        ),
        sets=[
            _marked(set_info(ts, now), configured) if shown is None or shown(ts) else _withheld(ts)
            for ts in store.held()
        ],
        fallbacks=[fallback_info(f, wall) for f in fallbacks or ()],
        backings=[
            pb.BackingInfo(
                name=b.name,
                where=bu.where,
                total_bytes=bu.total,
                used_bytes=bu.used,
                free_bytes=bu.free,
                page_size=bu.page_size,
                survives_restart=b.survives_restart,
                stands_in_for=b.stands_in_for,
                reason=b.reason,
                small_pages_reason=b.small_pages_reason,
                small_pages_fix=b.small_pages_fix,
            )
            for b, bu in usages
        ],
    )
