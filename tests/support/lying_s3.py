"""An S3 endpoint that lies, for the object-store source's tests: `python lying_s3.py HOST PORT
FOLDER MODE`. It serves FOLDER's files as the objects `<bucket>/<prefix>/<name>` (any bucket
and prefix: the last part of the path names the file), answers ranged GETs, and lies by MODE:

- late: the header range (from byte 0) of every object is a 404 at once; every other range
  is answered correctly, 0.3 s later (NIXL reports the request failed while those are still
  being written into the daemon's memory).
- window: the first range past the header of the largest object is a 404; the others as
  in late.
- whole: Range is ignored: 200 with the whole object.
- more: 206 with 64 KiB more bytes than the range asked for.
- head: "HTTP/1.1 200 OK", then a header's bytes, one a second, for as long as the
  connection stays open.
- honest: no lie (what the bucket holds is the attack: headers of many entries, a header
  of a large tensor with no attested manifest beside it).

Only the ranges asked are read from FOLDER's files (which may be large and sparse).

It prints "listening" once it accepts connections and, for each request, one line
"GET <path> <range> -> <status> <bytes>".
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EXTRA = 64 << 10
DELAY_S = 0.3


class Liar(BaseHTTPRequestHandler):
    """One request, answered as the server's mode lies."""

    folder: Path
    mode: str
    largest: str
    lock = threading.Lock()
    window_refused = False

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _object(self) -> Path | None:
        name = self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
        path = self.folder / name
        return path if path.is_file() else None

    def do_HEAD(self) -> None:
        path = self._object()
        if path is None:
            self._status(404, b"")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()

    def do_GET(self) -> None:
        path = self._object()
        asked = self.headers.get("Range", "")
        if self.mode == "head":
            self._say(asked, 200, 0)
            with contextlib.suppress(OSError):
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                self.wfile.flush()
                for _ in range(3600):
                    time.sleep(1)
                    self.wfile.write(b"a")
                    self.wfile.flush()
            return
        if path is None:
            self._status(404, b"")
            self._say(asked, 404, 0)
            return
        size = path.stat().st_size
        found = re.fullmatch(r"bytes=(\d+)-(\d*)", asked)
        start = int(found.group(1)) if found else 0
        end = min(int(found.group(2)) + 1, size) if found and found.group(2) else size
        whole = self.mode == "whole" or not found
        with path.open("rb") as f:
            f.seek(0 if whole else start)
            data = f.read(size if whole else end + EXTRA - start)
        if self.mode in ("late", "window") and self._refused(path, start, end - start):
            self._status(404, b"<Error><Code>NoSuchKey</Code></Error>")
            self._say(asked, 404, 0)
            return
        if self.mode in ("late", "window"):
            time.sleep(DELAY_S)
        if whole:
            body, status = data, 200
        elif self.mode == "more":
            body, status = data, 206
        else:
            body, status = data[: end - start], 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        # The daemon's transfer process may go away mid-answer.
        with contextlib.suppress(OSError):
            self.wfile.write(body)
        self._say(asked, status, len(body))

    def _refused(self, path: Path, start: int, n: int) -> bool:
        if self.mode == "late":
            return start == 0
        with self.lock:
            # A table window, not the header or a sample (4 KiB).
            if path.name == self.largest and start > 0 and n > EXTRA and not Liar.window_refused:
                Liar.window_refused = True
                return True
        return False

    def _status(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _say(self, asked: str, status: int, n: int) -> None:
        print(f"GET {self.path} {asked or '-'} -> {status} {n}", flush=True)


def main() -> None:
    """Serve until killed."""
    host, port, folder, mode = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    Liar.folder = folder
    Liar.mode = mode
    Liar.largest = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size).name
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((host, port), Liar)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
