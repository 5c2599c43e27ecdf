"""The ceiling of a peer fill: a raw TCP socket over the same veth, into tmpfs-backed memory.

    python -m bench.rawsock send PORT NBYTES        (prints "ready" once it listens, then the
                                                     CPU seconds its sending took)
    python -m bench.rawsock recv HOST PORT NBYTES   (prints GB/s and the CPU seconds it took)

The receiver reads with recv_into straight into a MAP_SHARED mapping of a
/dev/shm file whose pages were reserved first, as a fill writes into a
staged set; both ends use 8 MiB socket buffers, as UCX's TCP is given.
"""

from __future__ import annotations

import mmap
import os
import resource
import socket
import sys
import tempfile
import time

BUFFER = 8 << 20


def cpu_seconds() -> float:
    """User and system CPU seconds this process took so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def send(port: int, nbytes: int) -> float:
    """Accept one connection and send it `nbytes` from the pages of a tmpfs file, as a
    serving daemon sends a set's: distinct bytes, not one buffer again and again (which
    stays in the CPU's cache, where no set of a GiB does). The CPU seconds the sending took."""
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
                start = cpu_seconds()
                with conn:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
                    sent = 0
                    while sent < nbytes:
                        sent += conn.send(view[sent : sent + BUFFER])
                return cpu_seconds() - start
        finally:
            view.release()
            source.close()


def recv(host: str, port: int, nbytes: int) -> tuple[float, float]:
    """Receive `nbytes` into reserved tmpfs pages; GB/s from connect to the last byte, and the
    CPU seconds that took."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        target = mmap.mmap(f.fileno(), nbytes)
        view = memoryview(target)
        try:
            start, cpu = time.perf_counter(), cpu_seconds()
            with socket.create_connection((host, port)) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got : got + BUFFER])
                    if n == 0:
                        raise EOFError(f"the sender stopped after {got} of {nbytes} bytes")
                    got += n
            return nbytes / (time.perf_counter() - start) / 1e9, cpu_seconds() - cpu
        finally:
            view.release()
            target.close()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        print(f"{send(int(sys.argv[2]), int(sys.argv[3])):.4f}")
    else:
        rate, cpu = recv(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        print(f"{rate:.4f} {cpu:.4f}")
