"""`attach()`: the one call a worker makes to get its Engram tables.

Shared when the node's daemon can serve them, private when it cannot (auto
mode, one warning per cause and process), an error in strict mode. See the
decision table in docs/architecture.md.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from engramd_client.cuda import PRIVATE_ROUTE, ROUTES, check_device, device_caps, parse_device
from engramd_client.cumem import import_set
from engramd_client.fdchannel import FdChannelUnreachable, collect
from engramd_client.handles import KINDS, MAPPERS, ON_FD_CHANNEL, HandleMapper, channel_path
from engramd_client.lease import Lease, report_fallback, share_error
from engramd_client.live import Backing, LiveAddress, delta_for, file_backing
from engramd_client.mapping import Region, RowRanges, check_row_names, map_fd, torch_dtype
from engramd_client.rejoin import start_rejoin
from engramd_client.tables import Move, Tables
from engramd_shared.channel import daemon_uid, open_channel, probe_socket
from engramd_shared.checkpoint import (
    DEFAULT_TENSORS,
    TablePlan,
    is_set_id,
    is_store_url,
    plan_tables,
)
from engramd_shared.config import CUDA_HANDLE_KINDS, ClientConfig
from engramd_shared.errors import (
    DaemonError,
    DaemonUnavailable,
    FingerprintMismatch,
    NoGpuRoute,
    NotAllowed,
    SegmentNotVisible,
    ShareError,
    UnknownSet,
)
from engramd_shared.fallbacks import MAX_REASON, FallbackRecord, folder_for, leave_record
from engramd_shared.families import family_of_selection
from engramd_shared.fileid import SourceFile
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc
from engramd_shared.process import pid_namespace, start_ticks
from engramd_shared.topology import local_node

log = logging.getLogger("engramd_client")

_warned: set[str] = set()


def _warn_once(cause: str, message: str) -> None:
    if cause in _warned:
        log.debug("%s", message)
        return
    _warned.add(cause)
    log.warning("%s", message)


def attach(
    checkpoint: str | os.PathLike[str],
    *,
    tensors: str = DEFAULT_TENSORS,
    rows: RowRanges | None = None,
    share: bool | None = None,
    socket: str | None = None,
    labels: Mapping[str, str] | None = None,
    populate: bool = False,
    device: str | None = None,
    pad_rows: bool = False,
) -> Tables:
    """Attach to the node's copy of a checkpoint's n-gram tables, or load them privately.

    Args:
        checkpoint: the checkpoint folder (or one .safetensors file) as this
            worker sees it, the id of a set the operator loaded, or the
            s3://bucket/prefix the operator had the daemon load (no private
            fallback is possible for either).
        tensors: fnmatch selection of tensor names; "auto" (the default): the tables
            of the checkpoint's family (engramd_shared.families). Row shards of one
            table (`X.shard_N.Y`) are one tensor `X.Y`.
        rows: {name: (start, stop)} maps only those rows of a tensor (a TP shard).
        share: None for auto (or ENGRAMD_SHARE), True strict, False private.
        socket: the daemon's socket; default ENGRAMD_SOCKET, then /run/engramd/engramd.sock.
        labels: shown with this worker's lease in `engramd status` (dp_rank, tp_rank, ...).
        populate: fill the page tables of shared mappings at attach (MAP_POPULATE):
            the attach takes longer, the first lookups no longer fault page by page.
        device: "cuda:N" (or ENGRAMD_DEVICE): the tables' pages are also made readable
            by CUDA device N in place, and `tables.cuda(name)` views them there;
            `tables.gpu_route` says how (engramd_client.cuda.ROUTES): the daemon's
            cuMem set imported, the shared mapping registered read-only (or read
            through the host's page tables), a writable shared mapping where the
            device cannot register read-only memory and the daemon allows it, else a
            private registered copy (auto; strict raises DeviceError).
        pad_rows: a range of `rows` may run past its table's end (an engine's padding
            rows): those rows read as zeros, the worker's own memory.

    Raises:
        CheckpointError: the checkpoint cannot be read at all.
        DeviceError: `device` names a device this worker cannot use (in every mode).
        ShareError: strict mode (or a bare set id) and the tables cannot be shared.
        ValueError: `rows` names an unselected tensor or a range outside it.
    """
    config = ClientConfig.from_env(socket=socket, share=share, device=device)
    # A device this worker cannot use is its configuration's error, in every share mode.
    index = parse_device(config.device)
    route: int = pb.GPU_ROUTE_UNSPECIFIED
    if index is not None:
        check_device(index)
        # What the device says decides the route before anything is attached or registered.
        route = device_caps(index).route()
    tables = _attach(config, checkpoint, tensors, rows, labels, populate, index, route, pad_rows)
    if index is not None and tables.device is None:
        try:
            tables.register_on(index, tables.gpu_route or PRIVATE_ROUTE)
        except BaseException:
            tables.close()
            raise
    return tables


def _attach(
    config: ClientConfig,
    checkpoint: str | os.PathLike[str],
    tensors: str,
    rows: RowRanges | None,
    labels: Mapping[str, str] | None,
    populate: bool,
    index: int | None,
    route: int,
    pad_rows: bool,
) -> Tables:
    target = os.fspath(checkpoint)
    if is_store_url(target):
        if config.share is False:
            raise ValueError(f"share=False needs a checkpoint folder; {target} has none here")
        target = _stored_set(config, target, tensors)
    plan = None if is_set_id(target) and not Path(target).exists() else plan_tables(target, tensors)
    if plan is not None:
        check_row_names(rows, [t.name for t in plan.tensors])
    if config.share is False:
        if plan is None:
            raise ValueError(f"share=False needs a checkpoint folder, not the set id {target}")
        return Tables.private(plan, rows, reason=None, thp=config.private_thp, pad_rows=pad_rows)
    try:
        tables = _attach_shared(
            config,
            target if plan is None else plan,
            rows,
            labels or {},
            populate,
            index,
            route,
            pad_rows,
        )
    except ShareError as e:
        if config.share or plan is None:
            raise
        reason = (
            f"{e}. Falling back to private tables ({plan.nbytes / 2**30:.2f} GiB in this process)."
        )
        _warn_once(e.cause, reason)
        if isinstance(e, DaemonUnavailable):
            # The daemon may come back: live tables move to its copy when it does.
            tables = _live_fallback(config, plan, rows, reason, labels or {}, route, pad_rows)
        else:
            tables = Tables.private(
                plan, rows, reason=reason, thp=config.private_thp, pad_rows=pad_rows
            )
        recorded = _leave_record(config, e, plan, reason, labels, tables)
        if not recorded and not isinstance(e, DaemonUnavailable | NotAllowed):
            # No record beside the socket (an older daemon): the daemon answered, count it.
            report_fallback(config, e.cause, plan.set_id, plan.nbytes)
    tables.reattach = functools.partial(
        attach,
        checkpoint,
        tensors=tensors,
        rows=rows,
        share=config.share,
        socket=config.socket,
        labels=labels,
        populate=populate,
        device=config.device,
        pad_rows=pad_rows,
    )
    return tables


def _leave_record(
    config: ClientConfig,
    error: ShareError,
    plan: TablePlan,
    reason: str,
    labels: Mapping[str, str] | None,
    tables: Tables,
) -> bool:
    """Leave the record `engramd status` lists this replica by (engramd_shared/fallbacks.py),
    held until `tables` close; where it cannot be left, say so once (False)."""
    record = FallbackRecord(
        pid=os.getpid(),
        pid_namespace=pid_namespace(),
        pid_start=start_ticks(os.getpid()) or 0,
        set_id=plan.set_id,
        checkpoint=str(plan.checkpoint),
        cause=error.cause,
        reason=reason[:MAX_REASON],
        nbytes=plan.nbytes,
        since=time.time(),
        labels={str(k): str(v) for k, v in (labels or {}).items()},
    )
    fd = leave_record(config.socket, record)
    if fd is None:
        # Info, not a second warning: a fallback gives one.
        log.info(
            "%s",
            f"this replica cannot leave its record in {folder_for(config.socket)} (no such "
            "folder, or this user is not in the socket's group): `engramd status` will not "
            "list it among the replicas that fell back",
        )
        return False
    # Released when the replica moves to the daemon's copy (live tables) or closes.
    tables.until_shared(functools.partial(os.close, fd))
    return True


def _live_fallback(
    config: ClientConfig,
    plan: TablePlan,
    rows: RowRanges | None,
    reason: str,
    labels: Mapping[str, str],
    route: int,
    pad_rows: bool,
) -> Tables:
    """Private live tables that look for the daemon and move to its copy (rejoin.py)."""
    tables = Tables.private_live(plan, rows, reason=reason, pad_rows=pad_rows)
    if tables.live:
        regions = tables.live_regions()
        start_rejoin(
            tables,
            config,
            lambda: _shared_move(config, plan, rows, labels, regions, route, pad_rows),
        )
        _follow(tables, config, rows, labels, route, pad_rows)
    return tables


def _follow(
    tables: Tables,
    config: ClientConfig,
    rows: RowRanges | None,
    labels: Mapping[str, str],
    route: int,
    pad_rows: bool,
) -> None:
    """Live tables move to each next generation of their set the daemon names."""
    regions = tables.live_regions()
    tables.follow_generations(
        lambda set_id: _shared_move(config, set_id, rows, labels, regions, route, pad_rows)
    )


def _shared_move(
    config: ClientConfig,
    target: TablePlan | str,
    rows: RowRanges | None,
    labels: Mapping[str, str],
    regions: Mapping[str, LiveAddress],
    route: int,
    pad_rows: bool,
) -> Move:
    """The daemon's copy of `target`'s rows (a plan of the worker's files, or the id of
    a set's next generation) as backings of the live `regions`, descriptors in hand and
    its lease held: a move that no longer needs the daemon to happen."""
    # Host memory only: a cuMem import is another range of addresses.
    handles = tuple(h for h in config.handles if h not in CUDA_HANDLE_KINDS)
    lease = Lease(config, _request(target, labels, handles, _device_name(config.device), route))
    backings = {}
    try:
        plan = target if isinstance(target, TablePlan) else None
        attachment = lease.wait_attached(plan.checkpoint.name if plan else str(target))
        if plan is not None:
            _check_sources(plan, attachment)
        owner = daemon_uid(config.socket, config.connect_timeout_s)
        writable = route == pb.GPU_ROUTE_REGISTER_WRITABLE
        if writable and attachment.gpu_route != route:
            raise NoGpuRoute(_no_gpu_route(parse_device(config.device), attachment))
        opened = _open(attachment, rows, config, owner, pad_rows)
        try:
            for name in list(opened):
                fd, region = opened.pop(name)
                if name not in regions:
                    os.close(fd)
                    continue
                if region.length + region.pad != regions[name].nbytes:
                    os.close(fd)
                    raise DaemonError(
                        f"engramd's set {attachment.set_id} holds {name} in "
                        f"{region.length + region.pad} bytes, these tables in "
                        f"{regions[name].nbytes}: not the same tables"
                    )
                backings[name] = file_backing(fd, region, regions[name], writable)
        finally:
            for fd, _ in opened.values():
                os.close(fd)
    except BaseException:
        for backing in backings.values():
            backing.close()
        lease.close()
        raise
    gpu_route = ROUTES.get(attachment.gpu_route) or ROUTES.get(route, "")
    return Move(backings, "shared", attachment.set_id, lease, gpu_route)


def _parts_of(attachment: pb.Attachment) -> dict[str, tuple[str, ...]]:
    """Each tensor's checkpoint tensors as the daemon tells them (a joined table's shards):
    a worker that attached by set id or store URL has no plan of its own to read them from."""
    return {t.name: tuple(t.parts) for t in attachment.tensors if t.parts}


def _stored_set(config: ClientConfig, url: str, tensors: str) -> str:
    """The id of the set the daemon loaded from the object store's `url`.

    Such a checkpoint has no files on the node to plan or fall back to: it is
    attached as the operator had the daemon load it (--checkpoint, engramd load).
    """
    probe_socket(config.socket, config.connect_timeout_s)
    try:
        with open_channel(config) as channel:
            reply = pb_grpc.TableServiceStub(channel).Status(
                pb.StatusRequest(), timeout=config.reply_timeout_s
            )
    except grpc.RpcError as e:
        raise share_error(e) from None
    family = family_of_selection(tensors)
    found = sorted(
        {
            s.set_id
            for s in reply.sets
            if s.checkpoint == url.rstrip("/")
            and s.published
            and s.state in ("loading", "ready")
            and (tensors == DEFAULT_TENSORS or (family is not None and s.family == family.name))
        }
    )
    if len(found) != 1:
        held = "several sets" if found else "no set"
        raise UnknownSet(
            f"engramd holds {held} loaded from {url} (with tensors={tensors!r}); a checkpoint "
            "in an object store has no files on the node and is attached as the operator "
            f"loaded it: start engramd with --checkpoint {url}, or run `engramd load {url}`"
            + ("; attach by set id" if found else "")
        )
    return found[0]


def backing_of(set_id: str, *, socket: str | None = None) -> str:
    """Where the daemon keeps set `set_id` ("tmpfs", "disk", "cuda-host", ... as `engramd
    status` names it): the backing of its copy, or where it would load it (the daemon's first
    backing) while it holds none.

    Raises DaemonUnavailable (a ShareError) where the daemon does not answer.
    """
    config = ClientConfig.from_env(socket=socket)
    probe_socket(config.socket, config.connect_timeout_s)
    try:
        with open_channel(config) as channel:
            reply = pb_grpc.TableServiceStub(channel).Status(
                pb.StatusRequest(), timeout=config.reply_timeout_s
            )
    except grpc.RpcError as e:
        raise share_error(e) from None
    held = [s.backing for s in reply.sets if s.set_id == set_id and s.state in ("loading", "ready")]
    if held:
        return held[0]
    return reply.backings[0].name if reply.backings else ""


def _request(
    target: TablePlan | str,
    labels: Mapping[str, str],
    handles: tuple[str, ...],
    device: str = "",
    route: int = pb.GPU_ROUTE_UNSPECIFIED,
) -> pb.AttachRequest:
    """The attach of `target` (a plan of the worker's files, or a set id) by this process."""
    plan = target if isinstance(target, TablePlan) else None
    return pb.AttachRequest(
        set_id=plan.set_id if plan else str(target),
        checkpoint=str(plan.checkpoint) if plan else "",
        tensors=plan.selection if plan else "",
        pid=os.getpid(),
        labels=dict(labels),
        accept=[KINDS[name] for name in handles],
        pid_namespace=pid_namespace(),
        pid_start=start_ticks(os.getpid()) or 0,
        numa_node=local_node(),
        device=device,
        gpu_route=route,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class TableInfo:
    """A selected tensor, as a worker learns it before it maps any row of it."""

    #: The set it is a tensor of (a worker that attaches it after checks the same set).
    set_id: str
    name: str
    #: Its safetensors dtype name (BF16, F8_E4M3, ...).
    dtype: str
    shape: tuple[int, ...]
    #: The checkpoint tensors it is joined from, in order (a table's row shards); () for a
    #: tensor of its own.
    parts: tuple[str, ...]
    #: Beside `parts`: the rows of each; () also where an older daemon does not say.
    part_rows: tuple[int, ...]


def describe(
    checkpoint: str | os.PathLike[str],
    *,
    tensors: str = DEFAULT_TENSORS,
    socket: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> list[TableInfo]:
    """The selected tensors of a checkpoint: what a worker needs to choose the rows it attaches.

    From a checkpoint folder's headers; for the s3://bucket/prefix the daemon
    loaded (no files on the node), from the daemon: it hands the set out to
    a lease that ends at once (after the set's load, where it still loads),
    and nothing of it is mapped here.

    Raises:
        CheckpointError: the checkpoint folder cannot be read.
        ShareError: the daemon cannot hand out the set of `checkpoint`'s URL;
            DaemonError where its answer does not add up.
    """
    target = os.fspath(checkpoint)
    if not is_store_url(target):
        plan = plan_tables(target, tensors)
        return [
            TableInfo(
                plan.set_id,
                t.name,
                t.dtype,
                t.shape,
                tuple(p.name for p in t.parts),
                tuple(p.shape[0] for p in t.parts),
            )
            for t in plan.tensors
        ]
    config = ClientConfig.from_env(socket=socket, share=True)
    set_id = _stored_set(config, target, tensors)
    handles = tuple(h for h in config.handles if h not in CUDA_HANDLE_KINDS)
    lease = Lease(config, _request(set_id, labels or {}, handles))
    try:
        attachment = lease.wait_attached(set_id)
    finally:
        lease.close()
    return [_table_info(attachment.set_id, t) for t in attachment.tensors]


def _table_info(set_id: str, handle: pb.TensorHandle) -> TableInfo:
    rows = tuple(handle.part_rows)
    if rows and (
        len(rows) != len(handle.parts)
        or not handle.shape
        or 0 in rows
        or sum(rows) != handle.shape[0]
    ):
        raise DaemonError(
            f"engramd says the {len(handle.parts)} row shards of {handle.name} hold {list(rows)} "
            f"rows, which are not its {list(handle.shape)[:1]}: a daemon of another engramd, "
            "or not engramd at that socket"
        )
    return TableInfo(
        set_id, handle.name, handle.dtype, tuple(handle.shape), tuple(handle.parts), rows
    )


def _device_name(text: str) -> str:
    index = parse_device(text)
    return "" if index is None else f"cuda:{index}"


def _attach_shared(
    config: ClientConfig,
    target: TablePlan | str,
    rows: RowRanges | None,
    labels: Mapping[str, str],
    populate: bool,
    index: int | None,
    route: int,
    pad_rows: bool,
) -> Tables:
    probe_socket(config.socket, config.connect_timeout_s)
    # cuMem allocations are GPU memory, or host memory only the driver can map.
    handles = tuple(h for h in config.handles if index is not None or h not in CUDA_HANDLE_KINDS)
    try:
        return _attach_as(config, target, rows, labels, populate, handles, index, route, pad_rows)
    except FdChannelUnreachable as unreachable:
        # FABRIC handles and paths need no fd channel (paths: the daemon's /dev/shm).
        paths = tuple(h for h in handles if h not in ON_FD_CHANNEL)
        if not paths:
            raise
        try:
            return _attach_as(config, target, rows, labels, populate, paths, index, route, pad_rows)
        except SegmentNotVisible as e:
            raise SegmentNotVisible(f"{unreachable}; and by path: {e}") from None
        except ShareError:
            raise unreachable from None


def _attach_as(
    config: ClientConfig,
    target: TablePlan | str,
    rows: RowRanges | None,
    labels: Mapping[str, str],
    populate: bool,
    handles: tuple[str, ...],
    index: int | None,
    route: int,
    pad_rows: bool,
) -> Tables:
    plan = target if isinstance(target, TablePlan) else None
    request = _request(target, labels, handles, _device_name(config.device), route)
    lease = Lease(config, request)
    try:
        attachment = lease.wait_attached(plan.checkpoint.name if plan else request.set_id)
        if plan is None:
            check_row_names(rows, [h.name for h in attachment.tensors])
        else:
            _check_sources(plan, attachment)
        # Who serves the socket, as the kernel says, before anything it handed out is mapped.
        owner = daemon_uid(config.socket, config.connect_timeout_s)
        if any(h.WhichOneof("handle") == "cumem" for h in attachment.tensors):
            return _imported_tables(attachment, rows, config, index, lease, plan)
        writable = route == pb.GPU_ROUTE_REGISTER_WRITABLE
        if writable and attachment.gpu_route != route:
            raise NoGpuRoute(_no_gpu_route(index, attachment))
        opened = _open(attachment, rows, config, owner, pad_rows)
        live = _live(opened, populate, writable)
        tensors = {} if live else _map(opened, populate, writable)
    except BaseException:
        lease.close()
        raise
    tables = Tables(
        live.tensors if live else tensors,
        mode="shared",
        set_id=attachment.set_id,
        lease=lease,
        parts=plan.checkpoint_names if plan else _parts_of(attachment),
        live=live.addresses if live else None,
        backings=live.backings if live else None,
    )
    # A daemon that records no route (engramd 0.2) left the worker's own choice standing.
    tables.gpu_route = ROUTES.get(attachment.gpu_route) or ROUTES.get(route, "")
    if tables.live:
        _follow(tables, config, rows, labels, route, pad_rows)
    return tables


def _no_gpu_route(index: int | None, attachment: pb.Attachment) -> str:
    kinds = {pb.HandleKind.Name(h.kind) for h in attachment.tensors}
    return (
        f"cuda:{index} cannot register read-only host memory "
        "(cudaDevAttrHostRegisterReadOnlySupported is 0, as on many x86 GPUs) and does not "
        "read host memory through the CPU's page tables, while engramd's set "
        f"{attachment.set_id} is mapped read-only ({', '.join(sorted(kinds))}); fixes: run the "
        "daemon with --backing cuda-host (workers import its pinned cuMem allocation), or "
        "start it with --allow-writable-gpu-mappings (workers then map tmpfs sets writable "
        "and could change the one copy every worker reads)"
    )


def _imported_tables(
    attachment: pb.Attachment,
    rows: RowRanges | None,
    config: ClientConfig,
    index: int | None,
    lease: Lease,
    plan: TablePlan | None,
) -> Tables:
    """Tables over the set's cuMem allocation, imported for the worker's device.

    The allocation's descriptor comes from the fd channel (or a FABRIC
    handle in the reply); CPU views exist for host memory only.
    """
    if index is None:
        raise DaemonError("engramd handed out cuMem handles to a worker that asked for no device")
    descriptors: dict[str, int] = {}
    if any(h.cumem.file for h in attachment.tensors):
        descriptors = collect(
            channel_path(config, attachment),
            attachment.lease_id,
            attachment.fd_channel.secret,
            config.reply_timeout_s,
        )
    try:
        imported = import_set(list(attachment.tensors), descriptors, index, rows)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    tables = Tables(
        imported.cpu,
        mode="shared",
        set_id=attachment.set_id,
        lease=lease,
        parts=plan.checkpoint_names if plan else _parts_of(attachment),
    )
    tables.set_views(imported.cuda, index, imported.release)
    tables.gpu_route = ROUTES[pb.GPU_ROUTE_CUMEM_IMPORT]
    return tables


def _check_sources(plan: TablePlan, attachment: pb.Attachment) -> None:
    """Refuse the daemon's copy when this worker's file is the one it loaded, since changed.

    The set id covers names, sizes, headers and samples of the data, not
    every byte: a row edited in place keeps it. The daemon's copy holds the
    file as it was; a worker that reads the very same file (same device and
    inode, or the same path on the same device) sees whether it has changed.
    """
    theirs = [SourceFile(**{f: getattr(s, f) for f in _SOURCE_FIELDS}) for s in attachment.sources]
    for mine in plan.sources:
        for loaded in theirs:
            replaced = (mine.path, mine.dev) == (loaded.path, loaded.dev) and mine.ino != loaded.ino
            if (mine.same_inode(loaded) and mine != loaded) or replaced:
                raise FingerprintMismatch(
                    f"{mine.path} changed on disk after engramd loaded it (size, mtime, ctime "
                    "or inode differ): its copy holds the earlier bytes; `engramd load "
                    f"{plan.checkpoint}` loads the new version"
                )


_SOURCE_FIELDS = ("path", "dev", "ino", "size", "mtime_ns", "ctime_ns")


@dataclass
class _LiveTensors:
    """A set's tensors at live addresses (engramd_client.live), each with its backing."""

    tensors: dict[str, torch.Tensor]
    addresses: dict[str, LiveAddress]
    backings: dict[str, Backing]

    def close(self) -> None:
        """Let go of the backings' descriptors (tables that will not be)."""
        for backing in self.backings.values():
            backing.close()


def _live(
    opened: dict[str, tuple[int, Region]], populate: bool, writable: bool
) -> _LiveTensors | None:
    """The opened tensors mapped at live addresses, whose backing a later generation can
    replace in place; None where a backing's pages cannot fall on a live range's (larger
    pages than it aligns to): the caller maps them as they are (`opened` is left open)."""
    made = _LiveTensors({}, {}, {})
    try:
        for name, (fd, region) in opened.items():
            dtype = torch_dtype(region.dtype)
            if region.length + region.pad == 0:
                made.tensors[name] = torch.empty(region.shape, dtype=dtype)
                continue
            address = LiveAddress(region.length + region.pad, delta_for(region.offset))
            backing = file_backing(os.dup(fd), region, address, writable)
            backing.populate = populate
            made.backings[name] = backing
            misfit = address.misfit(backing)
            if misfit is not None:
                log.debug("%s is mapped where it is, not at a live address: %s", name, misfit)
                made.close()
                return None
            address.apply(backing)
            made.addresses[name] = address
            made.tensors[name] = address.tensor(dtype, region.shape)
    except BaseException:
        made.close()
        for fd, _ in opened.values():
            os.close(fd)
        raise
    for fd, _ in opened.values():
        os.close(fd)
    opened.clear()
    return made


def _map(
    opened: dict[str, tuple[int, Region]], populate: bool, writable: bool
) -> dict[str, torch.Tensor]:
    """The opened tensors mapped where the kernel puts them (closes their descriptors)."""
    tensors = {}
    try:
        for name in list(opened):
            fd, region = opened.pop(name)
            tensors[name] = map_fd(fd, region, populate, writable)
    finally:
        for fd, _ in opened.values():
            os.close(fd)
    return tensors


def _open(
    attachment: pb.Attachment,
    rows: RowRanges | None,
    config: ClientConfig,
    owner: int,
    pad_rows: bool,
) -> dict[str, tuple[int, Region]]:
    """A read-only descriptor of each handed-out tensor's memory, and its region (`rows` cut)."""
    mappers: dict[str, HandleMapper] = {}
    opened: dict[str, tuple[int, Region]] = {}
    try:
        for handle in attachment.tensors:
            which = handle.WhichOneof("handle")
            if which not in MAPPERS:
                raise DaemonError(
                    f"engramd handed out a {which or 'kind'} handle, which this client cannot "
                    f"map (it maps {', '.join(MAPPERS)}); upgrade engramd_client"
                )
            if which not in mappers:
                mappers[which] = MAPPERS[which][1](config, owner)
            mapper = mappers[which]
            region = mapper.region(handle).cut(rows, pad_rows)
            opened[handle.name] = (mapper.open(attachment, handle), region)
    except BaseException:
        for fd, _ in opened.values():
            os.close(fd)
        raise
    finally:
        for mapper in mappers.values():
            mapper.close()
    return opened
