"""The worker's end of a lease: one open Attach stream, re-opened when it breaks.

The daemon counts a worker as attached while its Attach stream is open. When
the daemon restarts, the stream breaks; the worker keeps its mappings (the
files stay mapped even if they were unlinked) and this thread re-attaches by
set id with backoff until the new daemon answers, so the lease reappears in
status without the worker doing anything. The stream also brings the news
that makes the lease stale: the set loaded again (a new copy), or the copy
this worker maps failed verification.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc

from engramd_client.fdchannel import collect
from engramd_client.handles import channel_path
from engramd_shared.channel import open_channel
from engramd_shared.config import ClientConfig
from engramd_shared.errors import (
    BY_REASON,
    REASON_KEY,
    DaemonError,
    DaemonUnavailable,
    ShareError,
)
from engramd_shared.pb import engramd_pb2 as pb
from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

log = logging.getLogger("engramd_client")


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


class Lease:
    """A worker's lease: the one reader of its Attach stream, re-opened after a restart.

    The lease's thread reads the stream from the first event on. Until the
    set is handed out it passes every event to `wait_attached` in the
    attaching thread; afterwards it holds the stream and re-attaches by set
    id whenever the stream breaks. One thread per worker, and gRPC's own
    per-channel polling thread is not needed (single-threaded unary-stream
    calls): a node's workers attaching at once share two cores with the daemon.
    """

    def __init__(self, config: ClientConfig, request: pb.AttachRequest) -> None:
        self._config = config
        self._channel = open_channel(config)
        self._stub = pb_grpc.TableServiceStub(self._channel)
        self._request = request
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Events until the set is handed out; then an RpcError, or None when
        # the stream ended without it.
        self._inbox: queue.SimpleQueue[pb.AttachEvent | grpc.RpcError | None] = queue.SimpleQueue()
        self._nonce = ""
        #: The daemon's id of the lease; changes when it is re-established.
        self.lease_id = ""
        #: The daemon holds another copy of the set than the one this worker maps, or
        #: told it that copy failed verification.
        self.stale = False
        self._told_failed = False
        # The set's next generation as the daemon named it, and who wants to hear it.
        self._next: tuple[str, int] | None = None
        self._on_next: Callable[[str, int], None] | None = None
        self._call: Any = self._stub.Attach(request)  # a grpc.Call that is also the event iterator
        self._thread = threading.Thread(target=self._run, name="engramd-lease", daemon=True)
        self._thread.start()

    def wait_attached(self, what: str) -> pb.Attachment:
        """Wait until the daemon hands out the set; log its load progress meanwhile.

        A loading daemon sends progress several times a second, so
        `reply_timeout_s` without any event means it hangs (or the peer is not
        engramd): the caller falls back instead of waiting forever.
        """
        silence_s = self._config.reply_timeout_s
        last_logged = -1
        while True:
            try:
                item = self._inbox.get(timeout=silence_s)
            except queue.Empty:
                raise DaemonUnavailable(
                    f"engramd did not answer for {silence_s} s while attaching {what} "
                    "(hung, or not engramd at that socket); restart it"
                ) from None
            if item is None:
                raise DaemonUnavailable(
                    "engramd closed the attach stream before it sent the tables"
                )
            if isinstance(item, grpc.RpcError):
                raise share_error(item)
            kind = item.WhichOneof("event")
            if kind == "attached":
                self.lease_id = item.attached.lease_id
                return item.attached
            if kind == "progress":
                p = item.progress
                percent = 100 * p.bytes_done // max(p.bytes_total, 1)
                if percent // 10 > last_logged:
                    last_logged = percent // 10
                    log.info(
                        "engramd is loading %s: %d%% of %d MiB", what, percent, p.bytes_total >> 20
                    )
            elif kind == "draining":
                raise DaemonUnavailable("engramd is stopping; it sent no tables")

    def _run(self) -> None:
        try:
            for event in self._call:
                if event.WhichOneof("event") == "attached":
                    self._nonce = event.attached.nonce
                    self._inbox.put(event)
                    break
                self._inbox.put(event)
            else:
                self._inbox.put(None)
                return
        except grpc.RpcError as e:
            self._inbox.put(e)
            return
        self._hold()

    def _hold(self) -> None:
        # From here on the worker maps the set; keep the lease, re-attaching
        # by set id whenever the stream breaks.
        request = pb.AttachRequest()
        request.CopyFrom(self._request)
        request.reattach = True
        request.nonce = self._nonce
        delay = self._config.reconnect_min_s
        call = self._call
        last_error = ""
        while True:
            try:
                for event in call:
                    kind = event.WhichOneof("event")
                    if kind == "attached":
                        self._adopt(event.attached)
                        delay = self._config.reconnect_min_s
                        last_error = ""
                    elif kind == "stale" and event.stale.next_set_id:
                        self._replaced(request.set_id, event.stale)
                    elif kind == "stale":
                        self._failed_verification(request.set_id, event.stale)
                    elif kind == "draining":
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
                        request.set_id,
                        last_error,
                    )
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, self._config.reconnect_max_s)
            with self._lock:
                if self._closed.is_set():
                    return
                call = self._call = self._stub.Attach(request)

    def _adopt(self, attachment: pb.Attachment) -> None:
        self.lease_id = attachment.lease_id
        # Stale as soon as the attachment says so: status shows the lease stale
        # from the moment the daemon sent it, before the fd channel's round trip.
        if attachment.nonce == self._nonce:
            log.info("engramd lease for set %s re-established", attachment.set_id)
        elif self._told_failed:
            log.info(
                "engramd holds a new copy of set %s, loaded again after this worker's copy "
                "failed verification: Tables.refresh() moves to it",
                attachment.set_id,
            )
        elif not self.stale:
            # The set was dropped and loaded again (after a failed verify, say):
            # this worker still reads the earlier copy, which nobody checks any
            # more. Mappings are never swapped under live tensors; the model
            # moves when it calls Tables.refresh() and binds the new tensors.
            self.stale = True
            log.warning(
                "engramd holds a new copy of set %s (dropped and loaded again); this worker "
                "still reads its earlier copy, and status marks its lease stale: call "
                "Tables.refresh() and bind the tables it returns",
                attachment.set_id,
            )
        if attachment.fd_channel.secret:
            self._show_self(attachment)

    def on_next_generation(self, callback: Callable[[str, int], None]) -> None:
        """Call `callback(set_id, generation)` (in the lease's thread) when the daemon names
        the set's next generation, the operator's new revision of it; at once if it did."""
        with self._lock:
            self._on_next = callback
            told = self._next
        if told is not None:
            callback(*told)

    def _replaced(self, set_id: str, news: pb.Stale) -> None:
        # A re-established lease hears it again: the tables know whether they are moving.
        with self._lock:
            self._next = (news.next_set_id, news.next_generation)
            callback = self._on_next
        log.info("engramd lease for set %s: %s", set_id, news.reason)
        if callback is not None:
            callback(news.next_set_id, news.next_generation)

    def _failed_verification(self, set_id: str, news: pb.Stale) -> None:
        # The daemon found changed bytes in the copy this worker maps: one warning
        # (a re-established lease hears it again). The mapping stays under live
        # tensors; the model moves when it calls Tables.refresh().
        self.stale = True
        if self._told_failed:
            return
        self._told_failed = True
        log.warning(
            "engramd lease for set %s: %s; this worker still reads that copy, and status "
            "marks its lease stale: call Tables.refresh() and bind the tables it returns "
            "(in auto mode, private tables until the set is loaded again)",
            set_id,
            news.reason,
        )

    def _show_self(self, attachment: pb.Attachment) -> None:
        """Meet the daemon on the fd channel, where the kernel names this process.

        A re-established lease is charged to this worker's uid and shows its
        pid verified only once the daemon's fd channel saw it (SO_PEERCRED);
        the descriptors themselves are not needed, the mappings stay.
        """
        try:
            fds = collect(
                channel_path(self._config, attachment),
                attachment.lease_id,
                attachment.fd_channel.secret,
                self._config.reply_timeout_s,
            )
        except ShareError as e:
            log.debug(
                "engramd lease %s: the fd channel did not see this worker: %s", self.lease_id, e
            )
            return
        for fd in fds.values():
            os.close(fd)

    def close(self) -> None:
        """End the lease now."""
        with self._lock:
            self._closed.set()
            self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()
