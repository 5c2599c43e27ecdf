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

Membership is what the kernel judged at connect(): while the socket's mode
lets no other user write it (0660), only its owner, a member of its group
or a process allowed to override file modes could connect, whatever pid
namespace the peer is in and wherever its groups come from (supplementary,
a container's group_add, primary). The daemon cannot check that again: a
peer in another pid namespace shows no /proc entry, and the daemon's group
database is not the peer's (another image's /etc/group). Only a socket
opened to every user (an operator's chmod) makes the daemon judge the
groups it can see itself.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import stat
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
        #: The socket's file, opened without following a link once bound: its mode and group
        #: say what connecting to it proves.
        self._inode: int | None = None
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
        self._inode = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)

    def start(self) -> None:
        """Accept connections on the running loop."""
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def stop(self) -> None:
        """Stop accepting, end the exchanges in progress, remove the socket."""
        tasks = [t for t in (self._accepting, *self._exchanges) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._inode is not None:
            os.close(self._inode)
            self._inode = None
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
        # The peer's own pid is the last of its NSpid (its pid in the pid
        # namespace the worker attached from); the daemon's view of it is peer.pid.
        nspid = peer.status_field("NSpid")
        admitted, proven = self._connected(peer)
        if not admitted and peer.uid not in (0, os.geteuid()):
            groups = _groups(peer, nspid, None)
            if self._gid not in groups:
                raise NotAllowed(
                    f"uid {peer.uid} is neither root, engramd's user, nor in the socket's group "
                    f"(gid {self._gid}): the daemon saw its groups {sorted(groups)} "
                    f"({_groups_from(peer, nspid, None)}), and {self.path} lets every user "
                    f"connect (mode {self._mode():04o}), so connecting proves nothing; make the "
                    "socket 0660 again (restart engramd), and give the worker the socket's "
                    "group (usermod -aG, compose's group_add, a pod's supplementalGroups)"
                )
        caller = Caller(
            pid=peer.pid,
            uid=peer.uid,
            own_pid=nspid[-1] if nspid else None,
            groups=functools.partial(_groups, peer, nspid, proven),
            groups_from=_groups_from(peer, nspid, proven),
        )
        return await self._leases.redeem(request.lease_id, request.secret, caller)

    def _mode(self) -> int:
        """The socket file's mode bits now."""
        assert self._inode is not None
        return stat.S_IMODE(os.fstat(self._inode).st_mode)

    def _connected(self, peer: Peer) -> tuple[bool, int | None]:
        """What the kernel proved by letting `peer` connect: whether it is its owner, in its
        group or allowed to override modes (False: a socket every user may write proves
        nothing), and the group it proved the peer is in (None: none)."""
        assert self._inode is not None
        st = os.fstat(self._inode)
        if st.st_mode & stat.S_IWOTH:
            return False, None
        if peer.uid in (0, st.st_uid) or not st.st_mode & stat.S_IWGRP:
            # The owner connects by its user bit; with no group write bit only the owner,
            # or a process allowed to override modes, could.
            return True, None
        return True, st.st_gid


def _groups(peer: Peer, nspid: list[int], proven: int | None) -> set[int]:
    """The peer's groups as the kernel showed them (_groups_from says where).

    From /proc where its pid is visible (`nspid`), else its primary group
    (SO_PEERCRED) and the socket's group where connecting proved it
    (`proven`). Never the daemon's group database: in another pid namespace
    the peer is most often in another container, whose /etc/group is not
    the daemon's, and a guess from it could give a set to a uid that may not
    read its checkpoint.
    """
    if nspid:
        return {peer.gid, *peer.status_field("Groups")}
    return {peer.gid} if proven is None else {peer.gid, proven}


def _groups_from(peer: Peer, nspid: list[int], proven: int | None) -> str:
    """Where _groups found the peer's groups, for a refusal."""
    if nspid:
        return f"from /proc/{peer.pid}/status"
    if proven is not None:
        return (
            "its pid is in a pid namespace the daemon cannot see: its primary group, and the "
            "socket's group, which connecting proved"
        )
    return "its pid is in a pid namespace the daemon cannot see: its primary group alone"


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
