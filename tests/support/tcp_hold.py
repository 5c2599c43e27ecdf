"""Hold idle TCP connections to a port until told to stop; print what the server did.

    python tests/support/tcp_hold.py HOST PORT COUNT

Connects COUNT times and sends nothing. Prints {"connected": n} once all are
made, then waits for a line on stdin and prints {"closed": how many the
server had closed by then}. Run in a network namespace of its own.
"""

from __future__ import annotations

import json
import socket
import sys


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1 << 16, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def main() -> int:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    held = []
    for _ in range(count):
        s = socket.create_connection((host, port), timeout=10)
        held.append(s)
    print(json.dumps({"connected": len(held)}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"closed": sum(_closed(s) for s in held)}), flush=True)
    for s in held:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
