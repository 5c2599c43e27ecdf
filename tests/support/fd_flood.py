"""Hold idle connections to the daemon's fd channel, reconnecting each one it closes.

    python tests/support/fd_flood.py FD_SOCKET COUNT

Opens COUNT SOCK_SEQPACKET connections that never send a request, prints
{"connected": N}, then keeps COUNT open (every connection the daemon closes,
by its deadline or its cap, is made again at once) until stdin closes, and
prints {"reconnects": N}. Run as another user (tests/support/run_as.py) to attack as
that user.
"""

from __future__ import annotations

import select
import socket
import sys

from engramd.testing.child import say

#: How long one connect may block (a full backlog) before the flood moves on.
CONNECT_TIMEOUT_S = 0.2
#: Poll interval: the flood re-opens what closed at least this often.
POLL_MS = 20


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(CONNECT_TIMEOUT_S)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def main() -> int:
    path, count = sys.argv[1], int(sys.argv[2])
    held: dict[int, socket.socket] = {}
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)

    def top_up() -> int:
        made = 0
        while len(held) < count:
            s = _connect(path)
            if s is None:
                break
            held[s.fileno()] = s
            poller.register(s, select.POLLIN | select.POLLHUP)
            made += 1
        return made

    say({"connected": top_up()})
    reconnects = 0
    while True:
        for fd, _ in poller.poll(POLL_MS):
            if fd == sys.stdin.fileno():
                for s in held.values():
                    s.close()
                say({"reconnects": reconnects})
                return 0
            # A reply (busy) or a hang-up: the daemon is done with this one.
            poller.unregister(fd)
            held.pop(fd).close()
        reconnects += top_up()


if __name__ == "__main__":
    sys.exit(main())
