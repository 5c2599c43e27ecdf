"""The worker side's settings, and the one place that reads its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Where the daemon listens unless told otherwise (systemd RuntimeDirectory).
DEFAULT_SOCKET = "/run/engramd/engramd.sock"

#: The words of an on/off setting (ENGRAMD_PRIVATE_THP).
_SWITCH_WORDS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
#: ENGRAMD_SHARE: an on/off setting that may also be left to the client (auto).
_SHARE_WORDS: dict[str, bool | None] = {"auto": None, "": None, "strict": True, **_SWITCH_WORDS}

#: Handle kinds a worker can map, by name, in the default order: cuMem allocations (only
#: with a device), by descriptor or FABRIC handle; then host memory by descriptor or path.
HANDLE_KINDS = ("cumem", "fabric", "fd", "shm")
#: The kinds of cuMem allocations: a worker accepts them only with a device.
CUDA_HANDLE_KINDS = ("cumem", "fabric")


@dataclass(frozen=True)
class ClientConfig:
    """How a worker attaches to the daemon."""

    #: Unix socket of the daemon's TableService.
    socket: str = DEFAULT_SOCKET
    #: None: share when possible, else private (auto); True: share or raise; False: private.
    share: bool | None = None
    #: Longest wait for the daemon to accept a connection before falling back.
    connect_timeout_s: float = 0.5
    #: Longest silence from the daemon while attaching (it reports load progress
    #: four times a second) before the worker gives up on it.
    reply_timeout_s: float = 2.0
    #: First and longest pause between reconnects after the daemon went away.
    reconnect_min_s: float = 0.05
    reconnect_max_s: float = 2.0
    #: Longest pause between a fallen-back worker's tries to reach its daemon (a connect).
    rejoin_max_s: float = 1.0
    #: The daemon's fd channel; "": the name the daemon gives, beside `socket`.
    fd_socket: str = ""
    #: Handle kinds to accept, preferred first: "cumem"/"fabric" (with a device), "fd" (any
    #: namespace), "shm" (paths).
    handles: tuple[str, ...] = HANDLE_KINDS
    #: Private tables on transparent huge pages (MADV_HUGEPAGE); False: 4 KiB pages only.
    private_thp: bool = True
    #: "cuda:N": the tables also get CUDA views on device N (registered in place); "": CPU only.
    device: str = ""
    #: An engine's PLE rows read each step on the host from a file mapping, no table
    #: allocated (the seed's disk_offload): None where the set is on the disk backing, True
    #: always (the checkpoint's own files without a daemon), False never.
    disk_offload: bool | None = None

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        socket: str | None = None,
        share: bool | None = None,
        device: str | None = None,
    ) -> ClientConfig:
        """Settings from ENGRAMD_SOCKET, _FD_SOCKET, _HANDLES, _SHARE, _PRIVATE_THP, _DEVICE,
        _DISK_OFFLOAD.

        Arguments win over the environment.
        """
        env = os.environ if env is None else env
        if share is None:
            word = env.get("ENGRAMD_SHARE", "auto").strip().lower()
            if word not in _SHARE_WORDS:
                raise ValueError(f"ENGRAMD_SHARE={word!r}: use auto, on or off")
            share = _SHARE_WORDS[word]
        words = env.get("ENGRAMD_HANDLES", "").split(",")
        handles = tuple(w.strip() for w in words if w.strip()) or HANDLE_KINDS
        if not set(handles) <= set(HANDLE_KINDS):
            raise ValueError(
                f"ENGRAMD_HANDLES={','.join(handles)!r}: use {','.join(HANDLE_KINDS)} or a "
                "part of it, preferred first"
            )
        device = (env.get("ENGRAMD_DEVICE", "") if device is None else device).strip()
        if not device and set(handles) <= set(CUDA_HANDLE_KINDS):
            raise ValueError(
                f"ENGRAMD_HANDLES={','.join(handles)!r} names only cuMem kinds, which a worker "
                "takes with a device only: set ENGRAMD_DEVICE (device=) or add fd,shm"
            )
        thp = env.get("ENGRAMD_PRIVATE_THP", "on").strip().lower()
        if thp not in _SWITCH_WORDS:
            raise ValueError(f"ENGRAMD_PRIVATE_THP={thp!r}: use on or off")
        offload = env.get("ENGRAMD_DISK_OFFLOAD", "auto").strip().lower()
        if offload not in _SHARE_WORDS or offload == "strict":
            raise ValueError(f"ENGRAMD_DISK_OFFLOAD={offload!r}: use auto, on or off")
        return cls(
            socket=socket or env.get("ENGRAMD_SOCKET") or DEFAULT_SOCKET,
            fd_socket=env.get("ENGRAMD_FD_SOCKET", ""),
            handles=handles,
            share=share,
            private_thp=_SWITCH_WORDS[thp],
            device=device,
            disk_offload=_SHARE_WORDS[offload],
        )
