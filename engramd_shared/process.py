"""Who a process is, in terms the kernel can check: its pid namespace and start time.

A pid alone is ambiguous: the same number names another process in another
pid namespace, or a later process once the first has exited. The pair
(namespace inode, start time in clock ticks after boot) does not.
"""

from __future__ import annotations

import os


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks after boot; None when no such process is visible."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after
    # its last ")". Field 22, starttime, is then the 20th.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])
