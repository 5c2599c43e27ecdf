"""The connection to the daemon's socket, with nothing of tables or torch in it.

Kept apart from the lease so `engramd status` and other command-line clients
import in tens of milliseconds and start no thread before they choose their
signal mask.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

import grpc

# grpc imports its channel machinery on the first channel (~7 ms): do it with
# the client's import, not inside a worker's first attach.
import grpc._channel

from engramd_shared.config import ClientConfig
from engramd_shared.errors import DaemonUnavailable, NotAllowed, SegmentNotVisible

_FIX_START = "start engramd (systemctl start engramd) or point ENGRAMD_SOCKET at its socket"


def probe_socket(path: str, timeout_s: float) -> None:
    """Raise DaemonUnavailable unless something accepts connections at `path`.

    A plain connect answers in microseconds where gRPC would wait out its
    connect timeout, and it tells a missing socket from a refused or a
    forbidden one.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except FileNotFoundError:
        raise DaemonUnavailable(f"no engramd socket at {path}; {_FIX_START}") from None
    except ConnectionRefusedError:
        raise DaemonUnavailable(
            f"nothing listens on {path} (engramd stopped?); {_FIX_START}"
        ) from None
    except PermissionError:
        raise NotAllowed(
            f"permission denied on {path}; add this worker's user to the socket's group "
            "(engramd by default) or run it with that group"
        ) from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot connect to {path}: {e}; {_FIX_START}") from None
    finally:
        sock.close()


def daemon_uid(path: str, timeout_s: float) -> int:
    """The uid of the process serving the socket at `path`, as the kernel names it.

    The owner of a socket file says who bound it, not who serves behind the
    name now; SO_PEERCRED of a connection says who listens. That process is
    the daemon only if no one else may have put it there: the socket's
    folder must belong to it (or root) and be writable by no one else.
    Raises SegmentNotVisible otherwise, before the worker maps anything.
    """
    folder = os.path.dirname(os.path.abspath(path))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
        _, uid, _ = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        st = os.stat(folder)
    except OSError as e:
        raise DaemonUnavailable(f"cannot connect to {path}: {e}; {_FIX_START}") from None
    finally:
        sock.close()
    why = ""
    if st.st_uid not in (uid, 0):
        why = f"belongs to uid {st.st_uid}, not to the daemon's (uid {uid}) or root"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"may be written by others than its owner (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        raise SegmentNotVisible(
            f"engramd's socket folder {folder} {why}: whoever may write it can stand in for "
            f"the daemon, so this worker maps nothing it hands out; make the folder the "
            "daemon's own, 0750 (engramd refuses to serve from any other)"
        )
    return int(uid)


def open_channel(config: ClientConfig) -> grpc.Channel:
    """A channel to the daemon's socket that reconnects quickly after a restart.

    Server-streaming calls are read by the thread that iterates them, not by
    a polling thread per channel. gRPC gives each connection attempt
    max(100 ms, min_reconnect_backoff) to finish its handshake, and fails
    the calls waiting on it when that runs out: a daemon answering 64
    workers at once on two busy cores takes longer than 100 ms. So the
    handshake gets the worker's answer timeout, while the pause between
    attempts stays short (initial_reconnect_backoff).
    """
    return grpc.insecure_channel(
        f"unix:{config.socket}",
        options=[
            ("grpc.enable_http_proxy", 0),
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
            ("grpc.initial_reconnect_backoff_ms", int(config.reconnect_min_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(config.reply_timeout_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(config.reconnect_max_s * 1000)),
        ],
    )
