"""The ceiling of a peer fill: a raw TCP socket over the same veth, into tmpfs-backed memory.

    python -m bench.rawsock send PORT NBYTES        (listens; prints "ready" once it does)
    python -m bench.rawsock recv HOST PORT NBYTES   (prints GB/s)

The receiver reads with recv_into straight into a MAP_SHARED mapping of a
/dev/shm file whose pages were reserved first, as a fill writes into a
staged set; both ends use 8 MiB socket buffers, as UCX's TCP is given.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import tempfile
import time

BUFFER = 8 << 20


def send(port: int, nbytes: int) -> None:
    """Accept one connection and send it `nbytes` from the pages of a tmpfs file, as a
    serving daemon sends a set's: distinct bytes, not one buffer again and again (which
    stays in the CPU's cache, where no set of a GiB does)."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        for at in range(0, nbytes, BUFFER):
            f.write(os.urandom(min(BUFFER, nbytes - at)))
        f.flush()
        source = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
        view = memoryview(source)
        try:
            with socket.create_server(("0.0.0.0", port)) as server:
                print("ready", flush=True)
                conn, _ = server.accept()
                with conn:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
                    sent = 0
                    while sent < nbytes:
                        sent += conn.send(view[sent : sent + BUFFER])
        finally:
            view.release()
            source.close()


def recv(host: str, port: int, nbytes: int) -> float:
    """Receive `nbytes` into reserved tmpfs pages; GB/s from connect to the last byte."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        target = mmap.mmap(f.fileno(), nbytes)
        view = memoryview(target)
        try:
            start = time.perf_counter()
            with socket.create_connection((host, port)) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got : got + BUFFER])
                    if n == 0:
                        raise EOFError(f"the sender stopped after {got} of {nbytes} bytes")
                    got += n
            return nbytes / (time.perf_counter() - start) / 1e9
        finally:
            view.release()
            target.close()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(int(sys.argv[2]), int(sys.argv[3]))
    else:
        print(f"{recv(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])):.4f}")
