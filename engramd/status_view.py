"""`engramd status`: ask the daemon what the node holds, print it for people or scripts."""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict

from engramd_client.config import ClientConfig
from engramd_client.layout import copy_name
from engramd_client.lease import open_channel
from engramd_client.pb import engramd_pb2 as pb
from engramd_client.pb import engramd_pb2_grpc as pb_grpc

from .text import escape
from .units import gib

#: How long `engramd status` waits for the daemon.
STATUS_TIMEOUT_S = 2.0


def fetch(socket: str) -> pb.StatusReply:
    """The daemon's StatusReply; raises grpc.RpcError when it does not answer."""
    with open_channel(ClientConfig(socket=socket)) as ch:
        reply: pb.StatusReply = pb_grpc.TableServiceStub(ch).Status(
            pb.StatusRequest(), timeout=STATUS_TIMEOUT_S
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
    for section in (doc["shm"], *doc["sets"], *doc["backings"]):
        for key, value in section.items():
            if key.endswith("bytes") or key in ("bytes_loaded", "page_size"):
                section[key] = int(value)
    for s, info in zip(doc["sets"], reply.sets, strict=True):
        s["saved_bytes"] = saved_bytes(info)
    doc["saved_bytes"] = sum(saved_bytes(s) for s in reply.sets)
    return doc


def _pages(size: int) -> str:
    if not size:
        return "-"  # a daemon older than the field
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size >> 10} KiB"


def _backing_lines(reply: pb.StatusReply) -> list[str]:
    shm = reply.shm
    if not reply.backings:  # a daemon older than the backings field
        page = shm.page_size or (2 << 20 if shm.huge_pages else 4096)
        return [
            f"shm {shm.dir}: {gib(shm.used_bytes)} used, {gib(shm.free_bytes)} free of "
            f"{gib(shm.total_bytes)}  ({_pages(page)} pages)"
        ]
    return [
        f"{b.name} {escape(b.where)}: {gib(b.used_bytes)} used, {gib(b.free_bytes)} free of "
        f"{gib(b.total_bytes)}  ({_pages(b.page_size)} pages; sets "
        f"{'survive' if b.survives_restart else 'do not survive'} a daemon restart)"
        for b in reply.backings
    ]


_KIND = {pb.HANDLE_KIND_FD: "fd", pb.HANDLE_KIND_SHM: "path"}


def render(reply: pb.StatusReply) -> str:
    """A readable summary of the node."""
    d = reply.daemon
    lines = [
        f"engramd {d.version}  pid {d.pid}  up {d.uptime_s:.0f} s  socket {d.socket}  "
        f"{'ready' if d.ready else 'not ready'}",
        *_backing_lines(reply),
        "",
    ]
    if reply.sets:
        lines.append(
            f"{'SET':20}  {'STATE':8}  {'BACKING':9}  {'PAGES':>7}  {'BYTES':>10}  {'LOADED':>6}  "
            f"{'LOCKED':6}  {'LEASES':>6}  CHECKPOINT"
        )
    else:
        lines.append("no sets")
    for s in reply.sets:
        loaded = f"{100 * s.bytes_loaded // max(s.bytes, 1)}%"
        state = s.state + ("*" if s.adopted else "")
        name = copy_name(s.set_id, s.numa_node if s.HasField("numa_node") else None)
        lines.append(
            f"{name:20}  {state:8}  {s.backing:9}  {_pages(s.page_size):>7}  "
            f"{gib(s.bytes):>10}  {loaded:>6}  "
            f"{'yes' if s.locked else 'no':6}  {s.lease_count:>6}  {escape(s.checkpoint)}"
        )
        if s.error:
            lines.append(f"    error: {escape(s.error)}")
        for lease in s.leases:
            labels = " ".join(f"{k}={v}" for k, v in sorted(lease.labels.items()))
            marks = ("" if lease.pid_verified else " (unverified)") + (
                "  STALE: maps an earlier copy" if lease.stale else ""
            )
            lines.append(
                f"    lease {lease.lease_id}  pid {lease.pid}{marks}  "
                f"by {_KIND.get(lease.kind, '?')}  {escape(labels)}"
            )
        if s.lease_count > len(s.leases):
            lines.append(f"    ... and {s.lease_count - len(s.leases)} more leases")
    if any(s.adopted for s in reply.sets):
        lines.append("(* adopted from an earlier daemon without reloading)")
    if any(lease.stale for s in reply.sets for lease in s.leases):
        lines.append(
            "(STALE: the set was loaded again, after a drop or a restart that did not keep it; "
            "those workers still read their earlier copy until they call Tables.refresh())"
        )
    total = sum(saved_bytes(s) for s in reply.sets)
    lines.append(f"host memory saved versus a private copy per lease: {gib(total)}")
    return "\n".join(lines)
