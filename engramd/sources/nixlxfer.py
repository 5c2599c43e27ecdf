"""NIXL as engramd uses it: an agent, memory registered, reads posted and polled to the end.

The calls relied on are nixl_cu12/_api.py's (nixl-cu12 1.5.1):
nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=[...])),
create_backend, register_memory / deregister_memory,
get_agent_metadata / add_remote_agent / remove_remote_agent (the metadata
travels over engramd's own gRPC, so no listener thread and no etcd),
get_xfer_descs, initialize_xfer("READ", ...), transfer, check_xfer_state,
release_xfer_handle. NIXL is imported when a source or the peer port
first needs it, never by a daemon that uses neither.
"""

from __future__ import annotations

import importlib
import logging
import secrets
import socket
import threading
import time
from typing import Any

from engramd.sources.base import SourceFailed

log = logging.getLogger("engramd")


class TransferFailed(SourceFailed):
    """A NIXL call failed, a transfer ended in error or outlived its deadline."""


class NixlMissing(SourceFailed):
    """NIXL cannot be imported here; the message names the fix."""


#: NIXL's builds, by the CUDA they were made for; any of them moves host memory.
BUILDS = ("nixl_cu12", "nixl_cu13")


def _nixl() -> Any:
    # The build's own module, not the `nixl` meta package: that one picks a
    # build by the CUDA it finds, and without one imports torch to ask it
    # (nixl_meta_utils.detect_cuda_major), which the daemon never does.
    for build in BUILDS:
        try:
            return importlib.import_module(f"{build}._api")
        except ImportError as e:
            missing = e
    raise NixlMissing(
        f"NIXL is not installed ({missing}); install it with `pip install --no-deps "
        "nixl-cu12==1.5.1 numpy` (make setup does)"
    )


def agent_name(purpose: str) -> str:
    """A name no other agent of the fleet has: the host, the pid, the purpose, a nonce."""
    return f"engramd-{socket.gethostname()}-{purpose}-{secrets.token_hex(4)}"


class Agent:
    """One NIXL agent; not thread-safe (NIXL's default without a listener): one user at a time."""

    def __init__(self, purpose: str, backends: list[str]) -> None:
        api = _nixl()
        self.name = agent_name(purpose)
        try:
            self._agent = api.nixl_agent(
                self.name, api.nixl_agent_config(enable_listen_thread=False, backends=backends)
            )
        except Exception as e:
            raise TransferFailed(f"cannot start a NIXL agent ({e})") from None

    def add_backend(self, backend: str, params: dict[str, str]) -> None:
        """Create a backend (OBJ) with its parameters."""
        try:
            self._agent.create_backend(backend, params)
        except Exception as e:
            raise TransferFailed(f"NIXL backend {backend}: {e}") from None

    def register(self, regions: list[tuple[int, int, int, str]], mem: str) -> Any:
        """Register (address, size, device, meta) regions of `mem` ("DRAM", "OBJ"); its handle."""
        try:
            return self._agent.register_memory(regions, mem)
        except Exception as e:
            raise TransferFailed(f"cannot register {mem} memory with NIXL ({e})") from None

    def deregister(self, handle: Any) -> None:
        """Undo `register`."""
        try:
            self._agent.deregister_memory(handle)
        except Exception as e:
            log.warning("NIXL could not deregister memory: %s", e)

    def metadata(self) -> bytes:
        """This agent's metadata, its registered memory included, for a peer's add_remote."""
        data: bytes = self._agent.get_agent_metadata()
        return data

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; the peer's agent name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferFailed(f"the peer's NIXL metadata was refused ({e})") from None
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Forget a peer agent (and disconnect from it)."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("NIXL could not forget agent %s: %s", name, e)

    def post(
        self,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_mem: str,
        remote_agent: str,
    ) -> Any:
        """Start a READ of `remote` descriptors into `local` DRAM ones; its handle for `wait`."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, remote_mem),
                remote_agent,
            )
        except Exception as e:
            raise TransferFailed(f"NIXL could not prepare the read ({e})") from None
        try:
            state = agent.transfer(handle)
        except Exception as e:
            self._release(handle)
            raise TransferFailed(f"NIXL could not start the read ({e})") from None
        if state == "ERR":
            self._release(handle)
            raise TransferFailed("NIXL reported the read failed")
        return handle

    def wait(self, handle: Any, deadline: float, cancel: threading.Event) -> None:
        """Return once the read of `handle` is complete, and release it.

        Polled busily: a 1 ms sleep between polls cut TCP throughput 2-10x.
        Raises TransferFailed on an error, past `deadline` (time.monotonic), or
        once `cancel` is set.
        """
        agent = self._agent
        try:
            state = agent.check_xfer_state(handle)
            while state == "PROC":
                if cancel.is_set():
                    raise TransferFailed("the load was cancelled")
                if time.monotonic() > deadline:
                    raise TransferFailed("the read outlived its deadline")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed("NIXL reported the read failed")
        except TransferFailed:
            raise
        except Exception as e:
            raise TransferFailed(f"the read failed ({e})") from None
        finally:
            self._release(handle)

    def done(self, handle: Any) -> bool:
        """Whether the read of `handle` is complete, without waiting; raises TransferFailed
        when it failed."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:
            raise TransferFailed(f"the read failed ({e})") from None
        if state == "ERR":
            raise TransferFailed("NIXL reported the read failed")
        return bool(state == "DONE")

    def read(
        self,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_mem: str,
        remote_agent: str,
        deadline: float,
        cancel: threading.Event,
    ) -> None:
        """`post` then `wait`: returns once every byte arrived."""
        self.wait(self.post(local, remote, remote_mem, remote_agent), deadline, cancel)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.debug("NIXL could not release a transfer: %s", e)
