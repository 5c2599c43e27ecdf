"""The fd channel: a set's read-only descriptors for the worker that holds its lease.

A SOCK_SEQPACKET Unix socket beside the worker socket (default `fds.sock`,
0660, the socket group), served on the daemon's event loop: one exchange
per connection, FdRequest{lease_id, secret} in, FdReply messages with the
descriptors (SCM_RIGHTS) or one FdReply{error, reason} out. The protocol
and every check are described in docs/architecture.md ("The fd channel").

This module is the socket's side: the caps on connections (MAX_CONNECTIONS
in all, `per_uid` for each peer uid, so idle connections of one user cannot
shut out another's workers), the request's size and deadline, the peer's
credentials (SO_PEERCRED) and membership (root, the daemon's user, or the
socket group). The lease's own checks and what the lease then records are
the lease book's: LeaseBook.redeem, given the peer as the kernel names it.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import functools
import grp
import logging
import os
import pwd
import socket
import struct
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from engramd.sets.leases import Caller, LeaseBook
from engramd_shared.errors import NotAllowed, Reason, SegmentNotVisible, ShareError, TooManyLeases
from engramd_shared.pb import engramd_pb2 as pb

log = logging.getLogger("engramd")

#: How long a connected peer may take to send its request (a worker sends it
#: right after connect()): an idle connection holds its slot no longer.
REQUEST_TIMEOUT_S = 1.0
#: How long a reply may wait for the worker to make room in its receive buffer.
SEND_TIMEOUT_S = 5.0
#: The largest request accepted.
MAX_REQUEST_BYTES = 1024
#: Exchanges served at once, all peers together; further connections are refused at once.
MAX_CONNECTIONS = 64
#: Descriptors per message (the kernel's SCM_MAX_FD is 253).
FDS_PER_MESSAGE = 250
#: Seconds between two log lines about one uid's refused requests: a peer that
#: sends bad requests in a loop must not flood the log (the rest are counted).
REFUSAL_LOG_INTERVAL_S = 60.0


#: What the fd channel answers with an error and no descriptor: its own checks refuse
#: with NotAllowed, the lease book's with these; each reason travels in FdReply.reason.
REFUSALS = (NotAllowed, SegmentNotVisible, TooManyLeases)


@dataclass(frozen=True)
class Peer:
    """The connecting process, as the kernel saw it at connect() (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, conn: socket.socket) -> Peer:
        """The peer of a connected Unix socket."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return cls(*struct.unpack("3i", creds))

    def status_field(self, key: str) -> list[int]:
        """A list field of /proc/<pid>/status ("Groups", "NSpid"); [] where it is not visible."""
        if self.pid <= 0:
            return []
        try:
            fd = os.open(f"/proc/{self.pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            text = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        start = text.find(b"\n" + key.encode() + b":")
        if start < 0:
            return []
        end = text.find(b"\n", start + 1)
        return [int(v) for v in text[start + len(key) + 2 : end].split()]


class FdChannel:
    """Serves sets' read-only descriptors on a Unix socket: checks the peer is a member,
    and redeems the lease's secret in the lease book (LeaseBook.redeem), which judges the rest."""

    def __init__(self, path: str, gid: int | None, leases: LeaseBook, per_uid: int) -> None:
        self.path = path
        self._gid = os.getegid() if gid is None else gid
        self._leases = leases
        #: Exchanges one uid holds at once (0: only MAX_CONNECTIONS).
        self._per_uid = per_uid
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Task[None]] = set()
        #: Exchanges in progress by peer uid.
        self._by_uid: collections.Counter[int] = collections.Counter()
        #: Uids told about in the log since they last held no exchange.
        self._warned: set[int] = set()
        #: Per uid: when its last refused request was logged, and how many since were not.
        self._refusals: dict[int, tuple[float | None, int]] = {}

    def bind(self) -> None:
        """Create the listening socket (the caller sets its mode and group)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        sock.bind(self.path)
        sock.listen(128)
        self._sock = sock

    def start(self) -> None:
        """Accept connections on the running loop."""
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def stop(self) -> None:
        """Stop accepting, end the exchanges in progress, remove the socket."""
        tasks = [t for t in (self._accepting, *self._exchanges) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            # One accept per turn of the event loop: sock_accept completes at once
            # while connections wait, and a user who reconnects as fast as it is
            # refused would otherwise keep the loop (every attach, every other
            # exchange) to itself.
            await asyncio.sleep(0)
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                # EMFILE and the like: pause, do not spin; the next accept may work.
                log.warning("fd channel: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            try:
                peer = Peer.of(conn)
            except OSError as e:
                log.debug("fd channel: no peer credentials (%s)", e)
                conn.close()
                continue
            busy = self._busy(peer)
            if busy:
                # Said in one non-blocking message, so a worker knows to map by path.
                with contextlib.suppress(OSError):
                    conn.send(pb.FdReply(error=busy, reason=Reason.BUSY).SerializeToString())
                conn.close()
                continue
            self._by_uid[peer.uid] += 1
            task = loop.create_task(self._exchange(conn, peer))
            self._exchanges.add(task)
            task.add_done_callback(functools.partial(self._done, peer.uid))

    def _busy(self, peer: Peer) -> str:
        """Why a new connection of `peer` is refused now; "" when it is served."""
        if len(self._exchanges) >= MAX_CONNECTIONS:
            why = f"{MAX_CONNECTIONS} exchanges in progress, the channel's limit"
        elif self._per_uid and self._by_uid[peer.uid] >= self._per_uid:
            why = (
                f"uid {peer.uid} holds {self._by_uid[peer.uid]} connections, its limit "
                "(--fd-connections-per-uid)"
            )
        else:
            return ""
        if peer.uid not in self._warned:
            self._warned.add(peer.uid)
            log.warning("fd channel: refusing pid %d (uid %d): %s", peer.pid, peer.uid, why)
        return f"engramd's fd channel is busy: {why}"

    def _log_refusal(self, peer: Peer, why: ShareError) -> None:
        now = time.monotonic()
        last, unlogged = self._refusals.get(peer.uid, (None, 0))
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._refusals[peer.uid] = (last, unlogged + 1)
            return
        self._refusals[peer.uid] = (now, 0)
        log.warning(
            "fd channel: refused pid %d (uid %d): %s%s",
            peer.pid,
            peer.uid,
            why,
            f" ({unlogged} more of this uid's requests refused since the last line)"
            if unlogged
            else "",
        )

    def _done(self, uid: int, task: asyncio.Task[None]) -> None:
        self._exchanges.discard(task)
        self._by_uid[uid] -= 1
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]
            self._warned.discard(uid)

    async def _exchange(self, conn: socket.socket, peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                request = await asyncio.wait_for(
                    loop.sock_recv(conn, MAX_REQUEST_BYTES + 1), REQUEST_TIMEOUT_S
                )
            except (TimeoutError, OSError) as e:
                log.debug("fd channel: no request (%s)", e or "timed out")
                return
            try:
                files = await self._grant(request, peer)
            except REFUSALS as e:
                self._log_refusal(peer, e)
                with contextlib.suppress(OSError, TimeoutError):
                    await _send(conn, pb.FdReply(error=str(e), reason=e.reason), [])
                return
            try:
                for start in range(0, len(files), FDS_PER_MESSAGE):
                    batch = files[start : start + FDS_PER_MESSAGE]
                    reply = pb.FdReply(
                        files=[name for name, _ in batch],
                        more=start + FDS_PER_MESSAGE < len(files),
                    )
                    await _send(conn, reply, [fd for _, fd in batch])
            except (OSError, TimeoutError) as e:
                # The worker went away mid-exchange: what was in flight is the kernel's to free.
                log.debug("fd channel: reply to pid %d failed: %s", peer.pid, e)
            finally:
                for _, fd in files:
                    os.close(fd)

    async def _grant(self, data: bytes, peer: Peer) -> list[tuple[str, int]]:
        """The descriptors for a request, once every check passed; raises one of REFUSALS."""
        if len(data) > MAX_REQUEST_BYTES:
            raise NotAllowed(f"the request is longer than {MAX_REQUEST_BYTES} bytes")
        try:
            request = pb.FdRequest.FromString(data)
        except DecodeError:
            raise NotAllowed("the request is not an engramd.v1.FdRequest") from None
        if not self._member(peer):
            raise NotAllowed(
                f"uid {peer.uid} is neither root, engramd's user, nor in the socket's group"
            )
        # The peer's own pid is the last of its NSpid (its pid in the pid
        # namespace the worker attached from); the daemon's view of it is peer.pid.
        nspid = peer.status_field("NSpid")
        caller = Caller(
            pid=peer.pid,
            uid=peer.uid,
            own_pid=nspid[-1] if nspid else None,
            groups=functools.partial(_groups, peer, nspid),
        )
        return await self._leases.redeem(request.lease_id, request.secret, caller)

    def _member(self, peer: Peer) -> bool:
        if peer.uid in (0, os.geteuid()) or peer.gid == self._gid:
            return True
        if self._gid in peer.status_field("Groups"):
            return True
        # A peer whose groups /proc does not show (another pid namespace).
        try:
            members = grp.getgrgid(self._gid).gr_mem
            return pwd.getpwuid(peer.uid).pw_name in members
        except KeyError:
            return False


def _groups(peer: Peer, nspid: list[int]) -> set[int]:
    """The peer's groups: from /proc where its pid is visible (`nspid`), else the group database."""
    if nspid:
        return {peer.gid, *peer.status_field("Groups")}
    try:
        return set(os.getgrouplist(pwd.getpwuid(peer.uid).pw_name, peer.gid))
    except KeyError:
        return {peer.gid}


async def _send(conn: socket.socket, reply: pb.FdReply, fds: list[int]) -> None:
    """One message with `fds` attached; waits at most SEND_TIMEOUT_S for buffer space."""
    loop = asyncio.get_running_loop()
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    data = reply.SerializeToString()
    while True:
        try:
            conn.sendmsg([data], rights)
            return
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(conn, _resolve, writable)
            try:
                await asyncio.wait_for(writable, SEND_TIMEOUT_S)
            finally:
                loop.remove_writer(conn)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
