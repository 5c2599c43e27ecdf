"""One mapper per handle kind of host memory: from a daemon's handle to a read-only descriptor.

Every such kind ends the same way: `tables.map_fd` maps the descriptor
PROT_READ and views it as a tensor. A mapper only says how to get that
descriptor and what proves it is the daemon's. Adding a kind is one mapper
here plus its entry in MAPPERS (the oneof field name of
engramd.v1.TensorHandle). cuMem handles (already pinned, GPU-readable) are
imported by cumem.py instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from engramd_client.fdchannel import check_descriptor, collect
from engramd_client.mapping import Region
from engramd_shared.config import ClientConfig
from engramd_shared.errors import NotAllowed, SegmentNotVisible
from engramd_shared.layout import (
    MANIFEST_NAME,
    ManifestError,
    NotOwned,
    open_owned,
    read_manifest,
)
from engramd_shared.pb import engramd_pb2 as pb

FIX_NAMESPACE = (
    "run the worker in the daemon's IPC namespace and /dev/shm (docker --ipc=host or "
    "--ipc=container:<engramd>; in Kubernetes mount the daemon's /dev/shm hostPath or "
    "shared memory-backed emptyDir at the same path)"
)


def channel_path(config: ClientConfig, attachment: pb.Attachment) -> str:
    """ENGRAMD_FD_SOCKET, else the daemon's fd socket by name beside this worker's socket.

    The worker may see the socket folder at another path than the daemon
    (a container mount), so the daemon's own path is used only for its name.
    """
    if config.fd_socket:
        return config.fd_socket
    name = Path(attachment.fd_channel.socket).name or "fds.sock"
    return str(Path(config.socket).with_name(name))


class HandleMapper(Protocol):
    """Turns handles of one kind into read-only descriptors; `close` when done."""

    def region(self, handle: pb.TensorHandle) -> Region:
        """Which bytes of the descriptor hold the tensor."""

    def open(self, attachment: pb.Attachment, handle: pb.TensorHandle) -> int:
        """A read-only descriptor of the handle's memory; raises a ShareError otherwise."""

    def close(self) -> None:
        """Release what the mapper still holds."""


class PathMapper:
    """HANDLE_KIND_SHM: a file in the daemon's shm folder, opened by path.

    Needs the daemon's mount namespace. The file must be the daemon's own
    (owner, mode, no symlink) and its set's manifest must carry the nonce the
    daemon handed out: a worker that sees another /dev/shm finds none or
    another.
    """

    def __init__(self, config: ClientConfig, owner: int) -> None:
        #: The daemon's uid (the owner of its socket).
        self._owner = owner
        self._checked: set[str] = set()

    def close(self) -> None:
        """Nothing to release: each open is the caller's."""

    def region(self, handle: pb.TensorHandle) -> Region:
        """The handle's byte range of its file."""
        return Region(
            name=handle.name,
            dtype=handle.dtype,
            shape=tuple(handle.shape),
            path=handle.shm.path,
            offset=handle.shm.offset,
            length=handle.shm.length,
        )

    def open(self, attachment: pb.Attachment, handle: pb.TensorHandle) -> int:
        """The file, opened read-only, once its set folder proved to be the daemon's."""
        folder = handle.shm.set_dir
        if folder not in self._checked:
            self._check_folder(attachment, Path(folder))
            self._checked.add(folder)
        path = handle.shm.path
        try:
            return open_owned(Path(path), self._owner)
        except NotOwned as e:
            raise SegmentNotVisible(
                f"{path} is not engramd's own ({e}): refusing to map it"
            ) from None
        except PermissionError:
            raise NotAllowed(
                f"permission denied on {path}; add this worker's user to the group of the "
                "daemon's shm files (engramd by default)"
            ) from None
        except OSError as e:
            raise SegmentNotVisible(f"cannot open {path}: {e}; {FIX_NAMESPACE}") from None

    def _check_folder(self, attachment: pb.Attachment, folder: Path) -> None:
        try:
            manifest = read_manifest(folder, self._owner)
        except NotOwned as e:
            raise SegmentNotVisible(
                f"engramd holds set {attachment.set_id} at {folder}, but what this worker sees "
                f"there is not engramd's own ({e}): refusing to map it; {FIX_NAMESPACE}"
            ) from None
        except (OSError, ManifestError) as e:
            raise SegmentNotVisible(
                f"engramd holds set {attachment.set_id} at {folder}, but this worker cannot read "
                f"{folder / MANIFEST_NAME} ({getattr(e, 'strerror', None) or e}): it sees "
                f"another /dev/shm; {FIX_NAMESPACE}"
            ) from None
        if manifest.nonce != attachment.nonce:
            raise SegmentNotVisible(
                f"{folder} here is not the daemon's copy of set {attachment.set_id} (nonce "
                f"differs): this worker sees another /dev/shm; {FIX_NAMESPACE}"
            )


class FdMapper:
    """HANDLE_KIND_FD: descriptors collected once per attach on the daemon's fd channel.

    Works in any mount and IPC namespace: the worker needs only the socket
    folder. Each descriptor must be a read-only file of the daemon's user.
    """

    def __init__(self, config: ClientConfig, owner: int) -> None:
        self._config = config
        self._owner = owner
        self._fds: dict[str, int] | None = None

    def region(self, handle: pb.TensorHandle) -> Region:
        """The handle's byte range of its file."""
        return Region(
            name=handle.name,
            dtype=handle.dtype,
            shape=tuple(handle.shape),
            path=f"engramd descriptor {handle.fd.file!r}",
            offset=handle.fd.offset,
            length=handle.fd.length,
        )

    def open(self, attachment: pb.Attachment, handle: pb.TensorHandle) -> int:
        """A duplicate of the descriptor of the handle's file (collected on first use)."""
        if self._fds is None:
            self._fds = collect(
                channel_path(self._config, attachment),
                attachment.lease_id,
                attachment.fd_channel.secret,
                self._config.reply_timeout_s,
            )
            writable = attachment.gpu_route == pb.GPU_ROUTE_REGISTER_WRITABLE
            for name, received in self._fds.items():
                what = f"{attachment.set_id}/{name}"
                check_descriptor(received, self._owner, what, writable)
        fd = self._fds.get(handle.fd.file)
        if fd is None:
            raise SegmentNotVisible(
                f"engramd sent no descriptor for {handle.fd.file!r} of set {attachment.set_id}"
            )
        return os.dup(fd)

    def close(self) -> None:
        """Close the collected descriptors (the mappings keep the memory)."""
        for fd in (self._fds or {}).values():
            os.close(fd)
        self._fds = None


#: Every handle kind by its name in ENGRAMD_HANDLES (HANDLE_KINDS in config.py).
KINDS: dict[str, pb.HandleKind] = {
    "cumem": pb.HANDLE_KIND_CUMEM,
    "fabric": pb.HANDLE_KIND_CUMEM_FABRIC,
    "fd": pb.HANDLE_KIND_FD,
    "shm": pb.HANDLE_KIND_SHM,
}
#: Kinds whose handles are collected on the fd channel.
ON_FD_CHANNEL = ("cumem", "fd")

#: The mapper of each handle kind, by TensorHandle's oneof field, and the kind it maps.
#: A mapper is made per attach from the worker's settings and the daemon's uid.
MAPPERS: dict[str, tuple[pb.HandleKind, Callable[[ClientConfig, int], HandleMapper]]] = {
    "fd": (pb.HANDLE_KIND_FD, FdMapper),
    "shm": (pb.HANDLE_KIND_SHM, PathMapper),
}
