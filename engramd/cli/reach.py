"""Why `engramd status` got no answer, in the operator's words: what is wrong and the fix.

gRPC says "failed to connect to all addresses"; a plain connect to the
socket tells a missing daemon, a stopped one and a user the socket's group
shuts out apart, and the folder's group (readable where the socket is not)
names the group to join.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
from pathlib import Path

_START = (
    "start it (systemctl start engramd, or engramd serve as in docs/deploy.md), or give "
    "--socket (ENGRAMD_SOCKET) the path it serves on"
)


def unanswered(path: str, details: str) -> str:
    """One line: why the daemon at `path` did not answer, and what to do."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except FileNotFoundError:
        folder = Path(path).parent
        where = f"no folder {folder}" if not folder.is_dir() else f"no socket at {path}"
        return f"engramd is not running here ({where}); {_START}"
    except ConnectionRefusedError:
        return (
            f"engramd is not running: nothing listens on {path} (a socket left by a daemon "
            f"that stopped); {_START}"
        )
    except PermissionError:
        return refused(path)
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return f"{Path(path).parent} is not a folder: give --socket the daemon's socket path"
        return f"cannot connect to {path}: {e.strerror}; {_START}"
    finally:
        probe.close()
    return (
        f"engramd accepts connections on {path} but did not answer ({details}); it may be "
        "stuck or overloaded: see its log (journalctl -u engramd)"
    )


def refused(path: str) -> str:
    """The socket's group shut this user out: which user, which group, and the fix."""
    user = _name(os.geteuid())
    group = _socket_group(path)
    if group is None:
        return (
            f"permission denied on {path}: user {user} may not open it or its folder; run "
            "engramd status as a member of the socket's group, or as root"
        )
    return (
        f"permission denied on {path}: user {user} is not in the group `{group}` the socket "
        f"and its folder belong to; add it (usermod -aG {group} {user}, then log in again, or "
        f"sg {group} -c 'engramd status'), or run engramd status as root"
    )


def _socket_group(path: str) -> str | None:
    """The group of the socket, else of its folder (readable where the socket is not)."""
    for place in (path, str(Path(path).parent)):
        try:
            gid = os.stat(place).st_gid
        except OSError:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return None


def _name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
