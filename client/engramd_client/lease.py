"""The worker's end of a lease: one open Attach stream, re-opened when it breaks.

The daemon counts a worker as attached while its Attach stream is open. When
the daemon restarts, the stream breaks; the worker keeps its mappings (the
files stay mapped even if they were unlinked) and this thread re-attaches by
set id with backoff until the new daemon answers, so the lease reappears in
status without the worker doing anything.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import grpc

# grpc imports its channel machinery on the first channel (~7 ms): do it with
# the client's import, not inside a worker's first attach.
import grpc._channel

from .config import ClientConfig
from .errors import (
    BY_REASON,
    REASON_KEY,
    DaemonError,
    DaemonUnavailable,
    NotAllowed,
    ShareError,
)
from .pb import engramd_pb2 as pb
from .pb import engramd_pb2_grpc as pb_grpc

log = logging.getLogger("engramd_client")

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


def open_channel(config: ClientConfig) -> grpc.Channel:
    """A channel to the daemon's socket that reconnects quickly after a restart."""
    return grpc.insecure_channel(
        f"unix:{config.socket}",
        options=[
            ("grpc.enable_http_proxy", 0),
            ("grpc.initial_reconnect_backoff_ms", int(config.reconnect_min_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(config.reconnect_min_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(config.reconnect_max_s * 1000)),
        ],
    )


def report_fallback(config: ClientConfig, cause: str, set_id: str, nbytes: int) -> None:
    """Tell the daemon (best effort, a few ms) that this worker loads privately, and why."""
    try:
        with open_channel(config) as channel:
            pb_grpc.TableServiceStub(channel).ReportFallback(
                pb.FallbackReport(cause=cause, set_id=set_id, pid=os.getpid(), bytes=nbytes),
                timeout=0.5,
            )
    except grpc.RpcError:
        pass  # the daemon's metrics miss one count; the worker carries on


def share_error(e: grpc.RpcError) -> ShareError:
    """The client exception for an error status from the daemon."""
    reason = next((str(v) for k, v in e.trailing_metadata() or () if k == REASON_KEY), "")
    cls = BY_REASON.get(reason)
    if cls is None:
        unreachable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        cls = DaemonUnavailable if unreachable else DaemonError
    return cls(f"engramd: {e.details()}")


def wait_attached(call: Any, what: str, silence_s: float) -> pb.Attachment:
    """Read an Attach stream until the daemon hands out the set; log load progress.

    A loading daemon sends progress several times a second, so `silence_s`
    without any event means it hangs (or the peer is not engramd): a watchdog
    cancels the call and the worker falls back instead of waiting forever.
    """
    last_logged = -1
    heard = threading.Event()
    done = threading.Event()
    silent = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not heard.wait(silence_s) and not done.is_set():
                silent.set()
                call.cancel()
                return
            heard.clear()

    threading.Thread(target=watch, name="engramd-attach-watchdog", daemon=True).start()
    try:
        for event in call:
            heard.set()
            kind = event.WhichOneof("event")
            if kind == "attached":
                return event.attached
            if kind == "progress":
                p = event.progress
                percent = 100 * p.bytes_done // max(p.bytes_total, 1)
                if percent // 10 > last_logged:
                    last_logged = percent // 10
                    log.info(
                        "engramd is loading %s: %d%% of %d MiB", what, percent, p.bytes_total >> 20
                    )
            elif kind == "draining":
                raise DaemonUnavailable("engramd is stopping; it sent no tables")
    except grpc.RpcError as e:
        if silent.is_set():
            raise DaemonUnavailable(
                f"engramd did not answer for {silence_s} s while attaching {what} "
                "(hung, or not engramd at that socket); restart it"
            ) from None
        raise share_error(e) from None
    finally:
        done.set()
        heard.set()
    raise DaemonUnavailable("engramd closed the attach stream before it sent the tables")


class Lease:
    """Keeps a worker attached: owns the Attach stream and re-opens it after a restart."""

    def __init__(
        self,
        config: ClientConfig,
        channel: grpc.Channel,
        request: pb.AttachRequest,
        call: Any,  # grpc's stream call: a grpc.Call that is also the event iterator
        attachment: pb.Attachment,
    ) -> None:
        self._config = config
        self._channel = channel
        self._stub = pb_grpc.TableServiceStub(channel)
        self._request = pb.AttachRequest()
        self._request.CopyFrom(request)
        self._request.reattach = True
        self._call = call
        self._nonce = attachment.nonce
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: The daemon's id of the lease; changes when it is re-established.
        self.lease_id = attachment.lease_id
        self._thread = threading.Thread(target=self._hold, name="engramd-lease", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        delay = self._config.reconnect_min_s
        call = self._call
        last_error = ""
        while True:
            try:
                for event in call:
                    if event.WhichOneof("event") == "attached":
                        self._adopt(event.attached)
                        delay = self._config.reconnect_min_s
                        last_error = ""
                    elif event.WhichOneof("event") == "draining":
                        break
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                expected = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if not expected and e.details() != last_error:
                    # Once per distinct answer: the mapping keeps working meanwhile.
                    last_error = e.details()
                    log.warning(
                        "engramd lease for set %s: %s; this worker keeps its mapping and retries",
                        self._request.set_id,
                        last_error,
                    )
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, self._config.reconnect_max_s)
            with self._lock:
                if self._closed.is_set():
                    return
                call = self._call = self._stub.Attach(self._request)

    def _adopt(self, attachment: pb.Attachment) -> None:
        self.lease_id = attachment.lease_id
        if attachment.nonce != self._nonce:
            # The daemon reloaded the set; this worker still maps the earlier
            # copy, which holds the same bytes (same fingerprint).
            log.info(
                "engramd reloaded set %s; this worker keeps its earlier mapping", attachment.set_id
            )
        else:
            log.info("engramd lease for set %s re-established", attachment.set_id)

    def close(self) -> None:
        """End the lease now."""
        with self._lock:
            self._closed.set()
            self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()
