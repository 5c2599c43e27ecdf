"""The daemon's sockets: claimed and secured, and the defences of those anyone may reach.

grpcio shows no peer credentials, so the worker socket and the TCP ports
(peer, health) are defended by what every connection costs: idle
connections end, all of them together stay below the open-files limit,
Health's endless Watch is not served, and a call's (first) request must
arrive whole within a deadline. The TCP ports also cap their connections,
each connection's streams and the calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import grp
import inspect
import logging
import os
import resource
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engramd.config import DaemonConfig
from engramd.errors import DecodeGuard, NotInSocketGroup, UntrustedSocketFolder
from engramd_shared.fallbacks import FOLDER_MODE, folder_for

log = logging.getLogger("engramd")

#: Fewest connections the worker socket is given when --fd-reserve leaves fewer.
MIN_WORKER_CONNECTIONS = 64
#: The longest a call on the worker socket may take to send its request (shorter
#: where --idle-timeout is): engramd_client sends its small requests at once.
REQUEST_TIMEOUT_S = 5.0
#: Connections a TCP port (peer, health, metrics) holds at most; more are closed at once.
TCP_CONNECTIONS = 128
#: Streams one connection to a gRPC TCP port may have open at once (HTTP/2's
#: SETTINGS_MAX_CONCURRENT_STREAMS): a receiver fills over one, a probe checks on one.
TCP_STREAMS_PER_CONNECTION = 4
#: Calls a gRPC TCP port runs at once, all connections together; the next ones wait
#: in gRPC's queue, at most TCP_QUEUED_S, then end with RESOURCE_EXHAUSTED.
TCP_CALLS = 64
TCP_QUEUED_S = 5

#: The longest path of a Unix socket address (sun_path's 108 bytes, the last a NUL).
MAX_UNIX_PATH = 107


def check_socket_paths(sockets: dict[str, str]) -> None:
    """Refuse, naming the flags and the fix, socket paths that cannot all be served.

    `sockets`: each flag (--socket, --admin-socket, --fd-socket) and its path.
    Two flags on one path would have one listener take the other's place (a
    worker then meets the admin service, or a bare EADDRINUSE). A missing
    folder is made (claim_socket) only where the daemon owns the place: in a
    folder of its user's that no one else may write (/run for root, where
    systemd's RuntimeDirectory= is not used); elsewhere it is a typo, and
    never made with its parents.
    """
    seen: dict[str, str] = {}
    for flag, path in sockets.items():
        if len(path.encode()) > MAX_UNIX_PATH:
            raise ValueError(
                f"{flag} {path} is longer than {MAX_UNIX_PATH} bytes, the limit of a Unix "
                "socket address; choose a shorter path"
            )
        folder = Path(path).parent
        if not folder.exists() and not _owned_place(folder.parent):
            raise ValueError(
                f"{flag} {path}: its folder {folder} does not exist; fix the path, or make "
                f"the folder for engramd's user (install -d -m 0750 -o <user> {folder})"
            )
        if folder.exists() and not folder.is_dir():
            raise ValueError(
                f"{flag} {path}: {folder} is not a folder; give {flag} a path in a folder"
            )
        key = os.path.join(os.path.realpath(folder), Path(path).name)
        if key in seen:
            raise ValueError(
                f"{seen[key]} and {flag} are both {path}: each socket needs a path of its own "
                "(--admin-socket defaults to admin.sock and --fd-socket to fds.sock beside "
                f"--socket); give {flag} another path, or leave it unset"
            )
        seen[key] = flag


def group_id(name: str) -> int | None:
    """The gid of group `name`; None (with a warning) when there is none.

    Raises NotInSocketGroup when the group exists but the daemon's user may
    not give files to it: only root, or a member, may chown to a group, and
    the daemon would otherwise die on its first folder with a bare EPERM.
    """
    if not name:
        return None
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        log.warning(
            "group %r does not exist: the socket and the sets keep the daemon's group; "
            "create it (deploy/systemd/engramd.sysusers.conf) or set --socket-group",
            name,
        )
        return None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise NotInSocketGroup(
            f"engramd runs as uid {os.geteuid()} (gid {os.getegid()}), which is not a member of "
            f"its --socket-group {name!r} (gid {gid}), so it cannot give that group its sockets "
            f"and sets; add the user to the group (usermod -aG {name} <user>, or "
            f"SupplementaryGroups={name} in the unit), run it with that group (runAsGroup: "
            f"{gid}), or pass --socket-group naming a group it is in (--socket-group '' keeps "
            "its own)"
        )
    return gid


def _owned_place(folder: Path) -> bool:
    """`folder` exists, is the daemon's user's, and no one else may write it."""
    try:
        st = os.stat(folder)
    except OSError:
        return False
    writable = stat.S_IWGRP | stat.S_IWOTH
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & writable


def secure_socket(path: str, mode: int, gid: int | None) -> None:
    """Give the socket the daemon bound at `path` `mode` and, where given, group `gid`.

    Through a descriptor of the very socket (opened without following a
    symlink, checked to be a socket of the daemon's own), never by path:
    whatever is at the name by then is changed only if it is that socket.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise UntrustedSocketFolder(
                f"{path} is no longer the socket engramd bound (someone replaced it); "
                f"{_FIX_FOLDER.format(folder=Path(path).parent)}"
            )
        _secure_fd(fd, mode, gid)
    finally:
        os.close(fd)


def _secure_fd(fd: int, mode: int, gid: int | None) -> None:
    # chmod(2) has no descriptor form for O_PATH descriptors; the kernel follows
    # /proc/self/fd/N to the very inode, whatever its name has become.
    os.chmod(f"/proc/self/fd/{fd}", mode)
    if gid is not None:
        os.chown(f"/proc/self/fd/{fd}", -1, gid)


_FIX_FOLDER = (
    "the socket folder {folder} must be engramd's own and writable by no one else, or "
    "whoever may write it can stand in for the daemon: let engramd make it, or give it to "
    "engramd's user (chown <user> {folder}; chmod 0750 {folder}; the unit's "
    "RuntimeDirectory=, the DaemonSet's init container)"
)


def claim_records_folder(socket_path: str, gid: int | None) -> None:
    """Make (or take back) the folder beside the socket where workers that fall back leave
    their records (engramd_shared/fallbacks.py): the daemon's, its socket group's to write in.

    Best effort: without it, workers that cannot reach the daemon go unseen (a warning says so).
    """
    folder = folder_for(socket_path)
    try:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        fd = os.open(folder, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        log.warning(
            "cannot make %s, where workers that fall back to private tables leave a record "
            "(%s): engramd status will not list them",
            folder,
            e,
        )
        return
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            log.warning(
                "%s is not engramd's (uid %d): its records are not read", folder, os.geteuid()
            )
            return
        # chmod drops the setgid bit on a chown: the group first.
        if gid is not None:
            os.chown(f"/proc/self/fd/{fd}", -1, gid)
        os.chmod(f"/proc/self/fd/{fd}", FOLDER_MODE)
    finally:
        os.close(fd)


def claim_socket(path: str, gid: int | None) -> None:
    """Make the socket's folder (0750), or check it is the daemon's own and writable by no
    one else; remove a stale socket; refuse if a daemon answers."""
    folder = Path(path).parent
    made = not folder.exists()
    if made:
        # Missing only in a place of the daemon's own (check_socket_paths): never its parents.
        folder.mkdir(mode=0o750)
    fd = os.open(folder, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UntrustedSocketFolder(
                f"{folder} belongs to uid {st.st_uid}, not to engramd's user (uid "
                f"{os.geteuid()}); {_FIX_FOLDER.format(folder=folder)}"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedSocketFolder(
                f"{folder} may be written by others than its owner (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); {_FIX_FOLDER.format(folder=folder)}"
            )
        if made:
            _secure_fd(fd, 0o750, gid)
    finally:
        os.close(fd)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            log.info("removing stale socket %s", path)
            os.unlink(path)
            return
        # EPROTOTYPE: a live socket of another type (the fd channel is SOCK_SEQPACKET).
        if e.errno != errno.EPROTOTYPE:
            raise
    finally:
        probe.close()
    raise RuntimeError(f"another engramd is serving on {path}; stop it first or choose --socket")


def worker_socket_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """gRPC options of the worker socket: idle connections end, and leave descriptors over.

    grpcio shows no peer credentials, so no cap per peer is possible there:
    a connection that never finishes its handshake, or has no call in flight,
    is closed after `idle_timeout` (a lease's open stream is a call, so
    attached workers are never idle), and all the socket's connections
    together stay `fd_reserve` below the soft limit on open files: the admin
    socket, the fd channel and the sets' files keep theirs, and the TCP ports
    their TCP_CONNECTIONS each.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    tcp_ports = sum(bool(p) for p in (config.health_port, config.metrics_port, config.peer_listen))
    connections = soft - config.fd_reserve - tcp_ports * TCP_CONNECTIONS
    if connections < MIN_WORKER_CONNECTIONS:
        connections = max(soft // 2, 1)
        log.warning(
            "the open files limit (%d) leaves no room for --fd-reserve %d; the worker socket "
            "takes at most %d connections (raise LimitNOFILE=)",
            soft,
            config.fd_reserve,
            connections,
        )
    idle_ms = max(int(config.idle_timeout * 1000), 1)
    return [
        ("grpc.max_connection_idle_ms", idle_ms),
        ("grpc.server_handshake_timeout_ms", idle_ms),
        ("grpc.max_allowed_incoming_connections", connections),
    ]


def tcp_server(idle_timeout: float) -> grpc.aio.Server:
    """A gRPC server for a TCP port (peer, health), with the worker socket's defences and caps.

    Anyone who reaches the port may connect, so nothing a connection holds
    outlasts its use: a handshake and a call's first request have
    REQUEST_TIMEOUT_S (or `idle_timeout`, if shorter), a connection with no
    call in flight is closed after `idle_timeout`, and connections, streams
    per connection and calls in flight are capped (TCP_CONNECTIONS,
    TCP_STREAMS_PER_CONNECTION, TCP_CALLS), so a flood costs the daemon a
    bounded number of calls' memory, freed within the deadline.
    """
    request_s = min(REQUEST_TIMEOUT_S, idle_timeout)
    return grpc.aio.server(
        interceptors=[RequestDeadline(request_s), DecodeGuard()],
        options=[
            ("grpc.max_connection_idle_ms", max(int(idle_timeout * 1000), 1)),
            ("grpc.server_handshake_timeout_ms", max(int(request_s * 1000), 1)),
            ("grpc.max_allowed_incoming_connections", TCP_CONNECTIONS),
            ("grpc.max_concurrent_streams", TCP_STREAMS_PER_CONNECTION),
            ("grpc.server_max_unrequested_time_in_server", TCP_QUEUED_S),
        ],
        maximum_concurrent_rpcs=TCP_CALLS,
    )


class HealthCheckOnly(health_pb2_grpc.HealthServicer):
    """Health for the worker socket: Check only.

    A Watch stream is a call that never ends, so a connection holding one is
    never idle: whoever may connect could hold every connection the socket
    allows. The kubelet's gRPC probe calls Check only (a connection per probe,
    closed after it); tools that watch use the admin socket.
    """

    def __init__(self, health: health_aio.HealthServicer) -> None:
        self._health = health

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        """The serving status, as the daemon's one HealthServicer holds it."""
        return await self._health.Check(request, context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Refused: see the class."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "Health/Watch is served only on engramd's admin socket (a held stream keeps a "
            "connection from ever idling); use Health/Check",
        )


class RequestDeadline(grpc.aio.ServerInterceptor):
    """Cancels a call whose (first) request message has not arrived whole within `seconds`.

    grpcio runs a unary-request handler only once its message is complete,
    and nothing ends a call whose client stops halfway: the connection holds
    a call, so it never idles. Unary-request methods are served as
    request-streaming ones instead (the same messages on the wire), so the
    handler runs at once and waits for the request under this deadline; a
    request-streaming method (the peer port's Fill) gets its first message
    under it. What comes after (a lease's stream, a fill's windows) is not
    limited here.
    """

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's handler, reading its (first) request under the deadline."""
        handler = await continuation(details)
        if handler is None:
            return handler
        seconds = self._seconds
        if handler.request_streaming:
            streams = handler.stream_stream
            if streams is None or not inspect.isasyncgenfunction(streams):
                return handler  # none is served: stream_unary, or replies by context.write

            async def opened(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in streams(_opened_within(seconds, requests, context), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(
                opened, handler.request_deserializer, handler.response_serializer
            )
        first = functools.partial(_first_request, seconds)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await first(context), context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        stream = handler.unary_stream
        if stream is None:
            return handler
        if not inspect.isasyncgenfunction(stream):
            # Replies written with context.write (health's Watch).
            async def written(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await stream(await first(context), context)

            return grpc.stream_stream_rpc_method_handler(
                written, handler.request_deserializer, handler.response_serializer
            )

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for reply in stream(await first(context), context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, handler.request_deserializer, handler.response_serializer
        )


async def _first_request(seconds: float, context: grpc.aio.ServicerContext) -> Any:
    """A call's one request message, read within `seconds`; aborts the call otherwise."""
    try:
        request = await asyncio.wait_for(context.read(), seconds)
    except TimeoutError:
        await _too_late(seconds, context)
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request message")
    return request


async def _opened_within(
    seconds: float, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    """A stream's requests, the first of which must arrive within `seconds` (else aborted)."""
    it = aiter(requests)
    try:
        first = await asyncio.wait_for(anext(it), seconds)
    except TimeoutError:
        await _too_late(seconds, context)
    except StopAsyncIteration:
        return
    yield first
    async for request in it:
        yield request


async def _too_late(seconds: float, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the request did not arrive whole within {seconds:g} s of the call's start; "
        "send it at once (engramd's clients do)",
    )


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one; returns the new soft limit.

    Every connection holds a descriptor: at the usual soft limit of 1024, a
    thousand idle connects from one local user would leave no descriptor
    for status or attaches (systemd: LimitNOFILE= sets the hard limit).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("open files limit raised from %d to %d", soft, hard)
    return hard
