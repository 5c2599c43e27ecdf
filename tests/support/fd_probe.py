"""Collect a lease's descriptors from an fd channel and print one JSON line.

    python tests/support/fd_probe.py FD_SOCKET LEASE_ID SECRET

Prints {"files": [...]} or {"error": class name, "message": ...}. Run as
another user (tests/support/run_as.py) to see what the daemon grants that user.
"""

from __future__ import annotations

import os
import sys

from engramd.testing.child import say
from engramd_client import EngramdError
from engramd_client.fdchannel import collect


def main() -> int:
    path, lease_id, secret = sys.argv[1:4]
    try:
        fds = collect(path, lease_id, secret, timeout_s=10)
    except EngramdError as e:
        say({"error": type(e).__name__, "message": str(e)})
        return 0
    for fd in fds.values():
        os.close(fd)
    say({"files": sorted(fds)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
