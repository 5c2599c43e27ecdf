"""`engramd status`: ask the daemon what the node holds, print it for people or scripts."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from engramd.text import escape
from engramd.units import gib
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.layout import copy_name
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

#: How long `engramd status` waits for the daemon.
STATUS_TIMEOUT_S = 2.0
#: Columns when the width is not bounded: tables then take their natural width.
_UNBOUNDED = 10_000
#: SetInfo.state of a copy `engramd verify` found changed bytes in.
FAILED_VERIFICATION = "failed-verification"


def fetch(socket: str, admin_socket: str = "", timeout: float = STATUS_TIMEOUT_S) -> pb.StatusReply:
    """The daemon's StatusReply; raises grpc.RpcError when it does not answer in `timeout` s.

    Asked on `admin_socket` where this process may open it (its descriptors
    are kept apart from the worker socket's, which idle peers may fill), else,
    or where it does not answer (a daemon without it), on `socket`.
    """
    if admin_socket and os.access(admin_socket, os.R_OK | os.W_OK):
        try:
            with open_channel(ClientConfig(socket=admin_socket)) as ch:
                answer: pb.StatusReply = pb_grpc.AdminServiceStub(ch).Status(
                    pb.StatusRequest(), timeout=timeout
                )
                return answer
        except grpc.RpcError:
            pass
    with open_channel(ClientConfig(socket=socket)) as ch:
        reply: pb.StatusReply = pb_grpc.TableServiceStub(ch).Status(
            pb.StatusRequest(), timeout=timeout
        )
        return reply


def saved_bytes(s: pb.SetInfo) -> int:
    """Host memory that one shared copy saves against a private copy per lease."""
    return s.bytes * max(s.lease_count - 1, 0)


def as_dict(reply: pb.StatusReply) -> dict[str, Any]:
    """The reply as plain JSON types, field names as in the proto, every field present."""
    doc = MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    # JSON has no 64-bit integers, so protobuf's mapping writes them as
    # strings; byte counts are far below 2**53, so give scripts numbers.
    for section in (doc["shm"], *doc["sets"], *doc["backings"], *doc["fallbacks"]):
        for key, value in section.items():
            if key.endswith("bytes") or key in ("bytes_loaded", "page_size"):
                section[key] = int(value)
    for s, info in zip(doc["sets"], reply.sets, strict=True):
        s["saved_bytes"] = saved_bytes(info)
        s["bytes_per_node"] = {node: int(n) for node, n in s["bytes_per_node"].items()}
    doc["saved_bytes"] = sum(saved_bytes(s) for s in reply.sets)
    return doc


def _pages(size: int) -> str:
    if not size:
        return "-"  # a daemon older than the field
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size >> 10} KiB"


def _set_pages(s: pb.SetInfo) -> str:
    """The page size backing most of the set, and the share on huge pages where measured."""
    if not s.HasField("huge_page_bytes") or not s.huge_page_bytes:
        return _pages(s.page_size)
    share = 100 * s.huge_page_bytes // max(s.bytes, 1)
    return f"{_pages(s.page_size)} ({min(share, 100)}% huge)"


def _backings(reply: pb.StatusReply) -> Table:
    # USED: engramd's own sets there; FREE and TOTAL: the file system's or memory's.
    table = Table("BACKING", "WHERE", "USED", "FREE", "TOTAL", "PAGES", "SETS", box=box.SIMPLE)
    if not reply.backings:  # a daemon older than the backings field
        shm = reply.shm
        page = shm.page_size or (2 << 20 if shm.huge_pages else 4096)
        table.add_row("shm", Text(escape(shm.dir)), *_sizes(shm), _pages(page), "survive a restart")
    for b in reply.backings:
        kept = (
            "survive a daemon restart" if b.survives_restart else "do not survive a daemon restart"
        )
        table.add_row(b.name, Text(escape(b.where)), *_sizes(b), _pages(b.page_size), kept)
    for column in table.columns[2:6]:
        column.justify = "right"
    return _whole(table)


def _stand_ins(reply: pb.StatusReply) -> list[tuple[str, str, list[str]]]:
    """(backing asked for, why it cannot be used, the backings standing in) per such backing."""
    found: dict[tuple[str, str], list[str]] = {}
    for b in reply.backings:
        if b.stands_in_for:
            found.setdefault((b.stands_in_for, b.reason), []).append(b.name)
    return [(asked, reason, names) for (asked, reason), names in found.items()]


def _sizes(b: pb.BackingInfo | pb.ShmInfo) -> tuple[str, str, str]:
    return gib(b.used_bytes), gib(b.free_bytes), gib(b.total_bytes)


_KIND = {
    pb.HANDLE_KIND_FD: "fd",
    pb.HANDLE_KIND_SHM: "path",
    pb.HANDLE_KIND_CUMEM: "cumem",
    pb.HANDLE_KIND_CUMEM_FABRIC: "fabric",
}
#: How a lease's worker reads the set on its device, after the device's name.
_ROUTE = {
    pb.GPU_ROUTE_UNSPECIFIED: "",
    pb.GPU_ROUTE_CUMEM_IMPORT: " cumem import",
    pb.GPU_ROUTE_REGISTER_READ_ONLY: " registered read-only",
    pb.GPU_ROUTE_HOST_PAGE_TABLES: " host page tables",
    pb.GPU_ROUTE_REGISTER_WRITABLE: " registered writable!",
}


def _sets(reply: pb.StatusReply) -> Table:
    table = Table(
        "SET",
        "TABLES",
        "STATE",
        "BACKING",
        "PAGES",
        "BYTES",
        "LOADED",
        "LOCKED",
        "CACHED",
        "LEASES",
        "SOURCE",
        "CHECKPOINT",
        box=box.SIMPLE,
    )
    for column in table.columns[4:10]:
        column.justify = "right"
    table.columns[0].min_width = len("0" * 20 + "-node0")
    for s in reply.sets:
        table.add_row(
            copy_name(s.set_id, s.numa_node if s.HasField("numa_node") else None),
            s.family or "custom",
            s.state + ("*" if s.adopted else "") + ("+" if s.unconfigured else ""),
            s.backing,
            _set_pages(s),
            gib(s.bytes),
            f"{100 * s.bytes_loaded // max(s.bytes, 1)}%",
            _locked(s),
            _cached(s),
            str(s.lease_count),
            Text(escape(_source(s))),
            Text(escape(s.checkpoint)),
        )
        if s.error:
            table.add_row("", Text(f"error: {escape(s.error)}", style="red"), end_section=True)
    return _whole(table)


def _locked(s: pb.SetInfo) -> str:
    """Whether the set is locked in memory (a disk-backed set never is: see _cached)."""
    return "yes" if s.locked else "no"


def _cached(s: pb.SetInfo) -> str:
    """A disk-backed set's bytes in the page cache, its share, and its warm-up; "-" for a set
    held in memory whole."""
    if not s.HasField("resident_bytes"):
        return "-"
    share = f"{gib(s.resident_bytes)} {100 * s.resident_bytes // max(s.bytes, 1)}%"
    # Only the word: why a warm-up stopped is a line below the table (_warm_ups_stopped).
    warming = s.page_cache_warming.partition(":")[0]
    return f"{share} ({warming})" if warming else share


def _warm_ups_stopped(reply: pb.StatusReply) -> list[Text]:
    """Why each disk-backed set's page cache warm-up stopped early."""
    return [
        Text(f"set {s.set_id}: page cache warm-up {escape(s.page_cache_warming)}")
        for s in reply.sets
        if s.page_cache_warming.startswith("stopped")
    ]


def _source(s: pb.SetInfo) -> str:
    """Where the set's bytes came from (each source's share, where several gave: the peers,
    the object store, the files), and at what rate; while loading, the time left too."""
    source = s.source
    if s.bytes_by_source:
        given = max(sum(s.bytes_by_source.values()), 1)
        shares = {name: f"{name} {100 * n // given}%" for name, n in s.bytes_by_source.items()}
        peers = sorted(n for n in shares if n != "files" and not n.startswith("s3://"))
        named = [("peer " if len(peers) == 1 else "peers ") + ", ".join(shares[n] for n in peers)]
        others = [
            shares[n] for n in sorted(shares, key=lambda n: (n == "files", n)) if n not in peers
        ]
        source = ", ".join((named if peers else []) + others)
    if s.load_seconds and s.source != "adopted":
        rate = s.bytes_loaded / s.load_seconds
        if s.state != "loading":
            return f"{source} {rate / 1e9:.2f} GB/s"
        left = f"{(s.bytes - s.bytes_loaded) / rate:.0f} s left" if rate else "time left unknown"
        return f"{source} {rate / 1e9:.2f} GB/s, {left}"
    return source


#: The labels a worker's engine sets that status shows in columns of their own.
_ENGINE_LABELS = ("engine", "engine_version")


def _engine(labels: Mapping[str, str]) -> str:
    """The engine and its version, as the worker's labels say ("-": a bare client)."""
    return " ".join(labels[k] for k in _ENGINE_LABELS if labels.get(k)) or "-"


def _ranks(labels: Mapping[str, str]) -> str:
    """The worker's ranks (tp_rank=0 -> tp 0), as its labels say."""
    ranks = [
        f"{k.removesuffix('_rank')} {v}" for k, v in sorted(labels.items()) if k.endswith("_rank")
    ]
    return ", ".join(ranks) or "-"


def _other_labels(labels: Mapping[str, str]) -> str:
    """The labels that ENGINE and RANKS do not show."""
    return " ".join(
        f"{k}={v}"
        for k, v in sorted(labels.items())
        if k not in _ENGINE_LABELS and not k.endswith("_rank")
    )


def _ago(seconds: float) -> str:
    """How long ago, to the unit that reads best."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _leases(reply: pb.StatusReply) -> Table:
    table = Table(
        "SET",
        "LEASE",
        "PID",
        "UID",
        "ENGINE",
        "RANKS",
        "SINCE",
        "BY",
        "DEVICE",
        "LABELS",
        "",
        box=box.SIMPLE,
    )
    for s in reply.sets:
        for lease in s.leases:
            labels = _other_labels(lease.labels)
            marks = ("" if lease.pid_verified else "unverified pid  ") + (
                _stale(s) if lease.stale else _moving(s)
            )
            table.add_row(
                _generation(s),
                lease.lease_id,
                str(lease.pid),
                str(lease.uid) if lease.HasField("uid") else "?",
                Text(escape(_engine(lease.labels))),
                Text(escape(_ranks(lease.labels))),
                _ago(lease.attached_s),
                _KIND.get(lease.kind, "?"),
                lease.device + _ROUTE.get(lease.gpu_route, " ?") if lease.device else "cpu",
                Text(escape(labels)),
                Text(marks, style="yellow"),
            )
        if s.lease_count > len(s.leases):
            table.add_row(s.set_id, f"... and {s.lease_count - len(s.leases)} more leases")
    table.columns[0].min_width = 20
    return _whole(table)


def _fallbacks(reply: pb.StatusReply) -> Group:
    """The replicas holding private tables, then why each did (their records beside the
    socket): a line each under the table, which a long reason would otherwise widen."""
    table = Table(
        "PID",
        "UID",
        "ENGINE",
        "RANKS",
        "CAUSE",
        "SINCE",
        "PRIVATE",
        "SET",
        title="replicas that fell back to private tables",
        title_justify="left",
        box=box.SIMPLE,
    )
    for f in reply.fallbacks:
        table.add_row(
            str(f.pid) + ("" if f.pid_verified else "?"),
            str(f.uid),
            Text(escape(_engine(f.labels))),
            Text(escape(_ranks(f.labels))),
            Text(escape(f.cause)),
            _ago(f.since_s),
            gib(f.bytes),
            Text(escape(f.set_id)),
        )
    table.columns[6].justify = "right"
    why = [Text(f"pid {f.pid}: {escape(f.reason)}", style="yellow") for f in reply.fallbacks]
    return Group(_whole(table), *why)


def _unconfigured(reply: pb.StatusReply) -> list[Text]:
    """A line per set no configured checkpoint names, with the command that drops it."""
    return [
        Text(
            f"set {s.set_id} ({gib(s.bytes)}, {escape(s.checkpoint) or 'no path shown'}) is named "
            f"by no configured --checkpoint; `engramd drop {s.set_id}` frees it"
            + (" once its workers leave (or --force)" if s.lease_count else ""),
            style="yellow",
        )
        for s in reply.sets
        if s.unconfigured and s.set_id
    ]


def _generation(s: pb.SetInfo) -> str:
    """A set's id, with its generation once a load replaced one (engramd load)."""
    return f"{s.set_id} gen {s.generation}" if s.generation > 1 or s.replaced_by else s.set_id


def _moving(s: pb.SetInfo) -> str:
    """Where a lease of a replaced generation is moving."""
    return f"MOVING to gen {s.generation + 1} ({s.replaced_by})" if s.replaced_by else ""


def _stale(s: pb.SetInfo) -> str:
    """Why a lease of `s` is stale."""
    if s.state == FAILED_VERIFICATION:
        return "STALE: its copy failed verification"
    return "STALE: maps an earlier copy"


def _whole(table: Table) -> Table:
    # A narrow terminal folds a cell onto more lines; it never cuts an id or a path short.
    for column in table.columns:
        column.overflow = "fold"
    return table


def _worker_loads(d: pb.DaemonInfo) -> str:
    """What sets workers' attaches load may hold, and for how long unleased."""
    share = (
        f"at most {d.worker_share_per_uid:.0%} of what engramd may hold from one uid's files"
        if d.worker_share_per_uid
        else "no share per uid"
    )
    grace = (
        f"dropped {d.worker_set_grace_s:.0f} s after their last lease"
        if d.worker_set_grace_s
        else "kept with no lease"
    )
    return f"sets workers' attaches load: {share}, {grace}"


def render(reply: pb.StatusReply, width: int = 0) -> str:
    """A readable summary of the node: rich tables, `width` columns wide (0: as wide as needed).

    Text from outside (paths, labels, errors) is escaped, never read as markup.
    """
    d = reply.daemon
    parts: list[RenderableType] = [
        Text(
            f"engramd {d.version}  pid {d.pid}  up {d.uptime_s:.0f} s  socket {d.socket}  "
            f"{'ready' if d.ready else 'not ready'}"
        ),
    ]
    parts += [
        Text(
            f"configured checkpoint {escape(f.checkpoint)} is not loaded: {escape(f.error)}",
            style="red",
        )
        for f in d.failed_checkpoints
    ]
    parts += [_backings(reply), Text(_worker_loads(d))]
    if d.writable_gpu_mappings:
        parts.append(
            Text(
                "--allow-writable-gpu-mappings: workers whose GPU cannot register read-only "
                "memory map tmpfs sets writable (leases marked 'writable!'), and any of them "
                "could change the one copy every worker reads; `engramd verify SET` finds it",
                style="yellow",
            )
        )
    for asked, reason, instead in _stand_ins(reply):
        parts.append(
            Text(
                f"--backing {asked} cannot be used here: {reason}; {'/'.join(instead)} "
                f"{'stands' if len(instead) == 1 else 'stand'} in for it, and workers with a "
                "device register their own mapping",
                style="yellow",
            )
        )
    for b in reply.backings:
        if b.small_pages_reason:
            parts.append(Text(escape(b.small_pages_reason), style="yellow"))
            if b.small_pages_fix:
                parts.append(Text(f"  the fix: {escape(b.small_pages_fix)}", style="yellow"))
    parts.append(_sets(reply) if reply.sets else Text("no sets"))
    parts += _warm_ups_stopped(reply)
    if any(s.leases for s in reply.sets):
        parts.append(_leases(reply))
    if any(s.adopted for s in reply.sets):
        parts.append(Text("(* adopted from an earlier daemon without reloading)"))
    if any(s.unconfigured for s in reply.sets):
        parts.append(Text("(+ named by no configured checkpoint)"))
        parts += _unconfigured(reply)
    if reply.fallbacks:
        parts.append(_fallbacks(reply))
        held, n = sum(f.bytes for f in reply.fallbacks), len(reply.fallbacks)
        parts.append(
            Text(f"host memory held privately by {n} replica{'' if n == 1 else 's'}: {gib(held)}")
        )
        if any(not f.pid_verified for f in reply.fallbacks):
            parts.append(Text("(pid? as the worker said: another pid namespace, or unverified)"))
    if any(lease.stale for s in reply.sets for lease in s.leases):
        parts.append(
            Text(
                "(STALE: the set was loaded again, after a drop or a restart that did not keep "
                "it, or its copy failed verification; those workers still read that copy until "
                "they call Tables.refresh())"
            )
        )
    total = sum(saved_bytes(s) for s in reply.sets)
    parts.append(Text(f"host memory saved versus a private copy per lease: {gib(total)}"))
    out = io.StringIO()
    console = Console(file=out, width=width or _UNBOUNDED, color_system=None, highlight=False)
    console.print(Group(*parts))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())
