"""Collect a set's read-only descriptors from the daemon's fd channel (SCM_RIGHTS).

The worker's side of engramd/api/fdchannel.py: one SOCK_SEQPACKET connection,
one FdRequest with the lease id and the one-time secret of the Attachment,
FdReply messages with the descriptors attached until `more` is false.

A channel that refuses, resets, closes early, stays silent or says it is
busy raises FdChannelUnreachable (a ShareError): the worker then maps by
path, else loads privately. Nothing of the socket's own escapes as OSError.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import time

from google.protobuf.message import DecodeError

from engramd_shared.errors import (
    BY_REASON,
    DaemonError,
    NotAllowed,
    Reason,
    SegmentNotVisible,
    ShareError,
)
from engramd_shared.pb import engramd_pb2 as pb

#: The largest FdReply (names of up to 250 files).
_MAX_REPLY_BYTES = 64 << 10
_MAX_FDS = 253

FIX_FD_CHANNEL = (
    "mount the daemon's whole socket folder into the worker (it holds fds.sock beside "
    "engramd.sock), or set ENGRAMD_FD_SOCKET to where the worker sees fds.sock"
)


class FdChannelUnreachable(SegmentNotVisible):
    """Nothing answers at the fd channel's socket; paths may still work."""


class _Busy(FdChannelUnreachable):
    """The channel holds as many connections as it serves (of this uid, or in all)."""


#: The first and the longest pause before asking a busy channel again.
_BUSY_PAUSE_S = (0.01, 0.2)


def collect(path: str, lease_id: str, secret: str, timeout_s: float) -> dict[str, int]:
    """The daemon's read-only descriptors for a lease, by file name; the caller closes them.

    A busy channel (its exchanges are short) is asked again for up to
    `timeout_s`; then, as for any failure of the channel itself,
    FdChannelUnreachable.
    """
    deadline = time.monotonic() + timeout_s
    pause, longest = _BUSY_PAUSE_S
    while True:
        try:
            return _collect_once(path, lease_id, secret, timeout_s)
        except _Busy as e:
            if time.monotonic() + pause > deadline:
                raise FdChannelUnreachable(f"{e} (for {timeout_s:.1f} s)") from None
            time.sleep(pause)
            pause = min(pause * 2, longest)


def _collect_once(path: str, lease_id: str, secret: str, timeout_s: float) -> dict[str, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    fds: dict[str, int] = {}
    try:
        try:
            sock.connect(path)
        except PermissionError:
            raise NotAllowed(
                f"permission denied on engramd's fd channel {path}; add this worker's user to "
                "the socket's group (engramd by default)"
            ) from None
        except OSError as e:
            raise FdChannelUnreachable(
                f"cannot reach engramd's fd channel at {path} ({e.strerror}); {FIX_FD_CHANNEL}"
            ) from None
        try:
            sock.send(pb.FdRequest(lease_id=lease_id, secret=secret).SerializeToString())
        except OSError as e:
            # The daemon closed the connection before reading it: busy (its
            # reply says so, already queued here), or stopping.
            sock.settimeout(0)
            queued = None
            with contextlib.suppress(ShareError):
                queued, _ = _receive(sock, path, fds)
            if queued is not None and queued.reason == Reason.BUSY:
                raise _Busy(queued.error) from None
            raise FdChannelUnreachable(
                f"engramd's fd channel at {path} closed the connection ({e.strerror or e})"
            ) from None
        more = True
        while more:
            reply, more = _receive(sock, path, fds)
            if reply.reason == Reason.BUSY:
                raise _Busy(reply.error)
            if reply.error:
                refusal = BY_REASON.get(reply.reason, NotAllowed)
                raise refusal(f"engramd's fd channel refused: {reply.error}")
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        sock.close()
    return fds


def _receive(sock: socket.socket, path: str, into: dict[str, int]) -> tuple[pb.FdReply, bool]:
    try:
        data, received, flags, _ = socket.recv_fds(
            sock, _MAX_REPLY_BYTES, _MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
    except TimeoutError:
        raise FdChannelUnreachable(f"engramd's fd channel at {path} did not answer") from None
    except OSError as e:
        raise FdChannelUnreachable(
            f"engramd's fd channel at {path} failed ({e.strerror or e})"
        ) from None
    try:
        if not data:
            raise FdChannelUnreachable(
                f"engramd's fd channel at {path} closed before it sent the set"
            )
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise DaemonError(f"engramd's fd channel at {path} sent a message too large")
        try:
            reply = pb.FdReply.FromString(data)
        except DecodeError:
            raise DaemonError(f"engramd's fd channel at {path} sent garbage") from None
        if len(reply.files) != len(received):
            raise DaemonError(
                f"engramd's fd channel at {path} named {len(reply.files)} files but sent "
                f"{len(received)} descriptors"
            )
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    for name, fd in zip(reply.files, received, strict=True):
        if name in into:
            os.close(fd)
        else:
            into[name] = fd
    return reply, reply.more


def check_descriptor(fd: int, owner: int, what: str, writable: bool = False) -> None:
    """Raise SegmentNotVisible unless `fd` is a read-only regular file (or memfd) of `owner`'s.

    `writable`: read-write instead (a lease granted GPU_ROUTE_REGISTER_WRITABLE).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
        raise SegmentNotVisible(
            f"the descriptor of {what} is not a file of engramd's own (uid {st.st_uid}, "
            f"engramd's is {owner}): refusing to map it"
        )
    expected = os.O_RDWR if writable else os.O_RDONLY
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != expected:
        said = "read-write" if writable else "read-only"
        raise SegmentNotVisible(f"the descriptor of {what} is not {said}: refusing it")
