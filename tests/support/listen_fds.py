"""Start a command the way systemd passes stored descriptors: LISTEN_FDS from fd 3.

    python tests/support/listen_fds.py NAME=FD[,NAME=FD...] -- COMMAND [ARGS...]

Each FD (inherited from the caller) is moved to 3, 4, ... in the order
given; LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID (this process, which then
becomes COMMAND by exec) are set as sd_listen_fds(3) reads them.
"""

from __future__ import annotations

import fcntl
import os
import sys


def main() -> None:
    spec, separator, *command = sys.argv[1:]
    assert separator == "--", __doc__
    pairs = [item.split("=", 1) for item in spec.split(",") if item]
    # Out of the way first (above 3..3+n), so moving one into place never overwrites another.
    parked = [fcntl.fcntl(int(fd), fcntl.F_DUPFD_CLOEXEC, 3 + len(pairs)) for _, fd in pairs]
    for i, fd in enumerate(parked):
        os.dup2(fd, 3 + i)  # inheritable, as systemd passes them
        os.close(fd)
    os.environ.update(
        LISTEN_PID=str(os.getpid()),
        LISTEN_FDS=str(len(pairs)),
        LISTEN_FDNAMES=":".join(name for name, _ in pairs),
    )
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
