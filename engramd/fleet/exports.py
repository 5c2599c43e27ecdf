"""The transfer processes that serve copies to peers: one per copy and network interface,
shared by the streams that read it (Exports), each mapping only that copy, read-only
(Export: xferproc.py says why none runs in the daemon)."""

from __future__ import annotations

import os
import threading

from engramd.fleet.netdev import interface_of
from engramd.fleet.nixlxfer import Agent
from engramd.fleet.served import Offered, Served
from engramd_shared.errors import InvalidRequest, UnknownSet
from engramd_shared.pb import peer_pb2


class Export:
    """Served memory: a transfer process of its own that maps only one copy (a published one,
    or the staged set of a fill), read-only, and has it registered with its NIXL agent while
    streams read it (Exports)."""

    def __init__(self, memory: list[tuple[int, int, int]], receiver: str) -> None:
        """`memory`: each tensor's (fd, offset, bytes); the caller closes the fds."""
        self.agent = Agent({"UCX": {}}, peer=receiver, serves=True)
        try:
            self._addresses = self.agent.attach(memory, writable=False)
            self._sizes = [n for _, _, n in memory]
            self._metadata = self.agent.metadata()
        except BaseException:
            self.agent.close()
            raise

    def offer(self, manifest_json: str, offered: Offered, held: bytes) -> peer_pb2.SetOffer:
        """The copy described for the receiver: manifest, digests, their attestation, which
        pieces it holds (b"": all), where it lies."""
        return peer_pb2.SetOffer(
            manifest_json=manifest_json,
            nixl_metadata=self._metadata,
            regions=[
                peer_pb2.RemoteRegion(address=a, nbytes=n)
                for a, n in zip(self._addresses, self._sizes, strict=True)
            ],
            attestation=offered.attestation,
            strong_digests=offered.strong,
            piece_digests=offered.pieces,
            held=held,
        )

    def ended(self) -> str:
        """Why the transfer process ended before the stream did ("" while it runs)."""
        return self.agent.ended()

    def close(self) -> None:
        """End the transfer process: nothing of the copy is reachable any more."""
        self.agent.close()


class Exports:
    """The transfer processes serving copies: one per copy and network interface, shared by
    every stream that reads that copy over that interface (a warm node facing a fleet starts
    one, not one per receiver), ended with the last of those streams. One that died (a peer
    faulted it) is never handed out again: the next stream gets a new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[tuple[str, str], Export] = {}
        self._users: dict[int, int] = {}

    def take(self, served: Served, receiver: str) -> tuple[tuple[str, str], Export]:
        """The export of `served` for `receiver`'s interface (made, or shared); its key."""
        try:
            key = (served.key, interface_of(receiver))
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"no network interface reaches {receiver} ({e})") from None
        # One made at a time: a stream that comes meanwhile shares it rather than making one.
        with self._lock:
            export = self._current.get(key)
            if export is not None and not export.ended():
                self._users[id(export)] += 1
                return key, export
            try:
                mapped = served.memory()
            except LookupError as e:
                raise UnknownSet(str(e)) from None
            try:
                export = Export(mapped, receiver)
            finally:
                for fd, _, _ in mapped:
                    os.close(fd)
            self._current[key] = export
            self._users[id(export)] = 1
            return key, export

    def give(self, key: tuple[str, str], export: Export) -> None:
        """A stream is done with `export`: the last one ends its transfer process."""
        with self._lock:
            self._users[id(export)] -= 1
            if self._users[id(export)]:
                return
            del self._users[id(export)]
            if self._current.get(key) is export:
                del self._current[key]
        export.close()


class Opening:
    """The Export of one stream, taken on a pool thread while the stream may end first."""

    def __init__(self, exports: Exports) -> None:
        self._exports = exports
        self._lock = threading.Lock()
        self._taken: tuple[tuple[str, str], Export] | None = None
        self._ended = False

    def make(self, served: Served, receiver: str) -> Export:
        """The export of `served` for `receiver`, unless the stream ended meanwhile."""
        key, export = self._exports.take(served, receiver)
        with self._lock:
            if not self._ended:
                self._taken = (key, export)
                return export
        self._exports.give(key, export)
        raise InvalidRequest("the fill ended while its set was being exported")

    def end(self) -> None:
        """The stream ended: give its Export back, now or once it is taken."""
        with self._lock:
            self._ended = True
            taken, self._taken = self._taken, None
        if taken is not None:
            self._exports.give(*taken)
