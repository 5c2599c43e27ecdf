"""Which loads a worker's attach may start: allowed roots, mounts, the selection.

Workers may make the daemon read files and hold memory; the operator's
configuration says which. Every check resolves paths first (symlinks, "..")
and judges the files the daemon would really read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from engramd.config import DaemonConfig
from engramd.errors import FingerprintDiffers, InvalidRequest, NotAllowed, SelectionRefused
from engramd.host.shmfs import mount_id
from engramd_client.core.checkpoint import TablePlan
from engramd_client.core.families import AUTO, FAMILIES
from engramd_client.core.pb import engramd_pb2 as pb


def resolve(checkpoint: str) -> Path:
    """The checkpoint path with symlinks and ".." resolved; InvalidRequest when it cannot be."""
    try:
        return Path(checkpoint).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise InvalidRequest(f"checkpoint {checkpoint!r} cannot be resolved ({e})") from None


class LoadPolicy:
    """The daemon's rules for loads that workers start."""

    def __init__(self, config: DaemonConfig) -> None:
        self._selection = config.tensors
        self._allowed = [Path(p).resolve() for p in config.allow_roots]
        self._configured = {str(Path(p).resolve()) for p in config.checkpoints}

    def check_request(self, request: pb.AttachRequest, loaded: list[str]) -> Path:
        """The resolved checkpoint a worker may have loaded; raises the refusal otherwise.

        `loaded` are the checkpoints of the sets the daemon holds.
        """
        self.selection(request)
        path = resolve(request.checkpoint)
        if not self._under_root(path) and str(path) in loaded:
            # The worker's files are not the ones the daemon loaded from this
            # path: the checkpoint changed on disk, or the worker sees other
            # files there. Never hand out the old bytes.
            raise FingerprintDiffers(
                f"the checkpoint at {path} is not the one engramd loaded from there: it changed "
                f"on disk, or the worker sees other files there; `engramd load {path}` loads the "
                "new version, or give the daemon and the worker the same files"
            )
        if str(path) not in self._configured and not self._under_root(path):
            roots = ", ".join(map(str, self._allowed)) or "none"
            raise NotAllowed(
                f"engramd may not load {path} for a worker (allowed roots: {roots}); start the "
                f"daemon with --checkpoint {path} or --allow-root <dir>"
            )
        return path

    def selection(self, request: pb.AttachRequest) -> str:
        """The selection a worker's attach may load with: the configured one.

        With `auto` configured, any family's own selection (the worker's
        plan names its checkpoint's), else the family of each checkpoint.
        """
        allowed = {self._selection}
        if self._selection == AUTO:
            allowed |= {f.selection for f in FAMILIES}
        if request.tensors and request.tensors not in allowed:
            raise SelectionRefused(
                f"engramd loads for workers only its configured selection {self._selection!r}, "
                f"not {request.tensors!r}; attach with that selection, or have the operator load "
                "this one (engramd load --tensors)"
            )
        return request.tensors or self._selection

    def check_read(self, checkpoint: str) -> Path:
        """The resolved checkpoint, if the daemon may read it for a worker (as for a load).

        Proving a worker's copy reads its files in full, as a load would: the
        same roots apply, and `check_plan` judges each file.
        """
        path = resolve(checkpoint)
        if str(path) not in self._configured and not self._under_root(path):
            roots = ", ".join(map(str, self._allowed)) or "none"
            raise NotAllowed(
                f"engramd holds this set from other files than {path}, and may not read {path} "
                f"to compare it (allowed roots: {roots}); attach with the checkpoint the "
                "operator loaded, or start the daemon with --allow-root <dir>"
            )
        return path

    def check_plan(self, path: Path, plan: TablePlan, set_id: str) -> None:
        """Refuse a plan whose files leave the root, or whose set is not the worker's."""
        if str(path) not in self._configured:
            # Every file, not just the folder: a shard that is a symlink to
            # another user's checkpoint resolves outside the root. resolve()
            # undoes symlinks and "..", not bind mounts: a file bound into the
            # root from elsewhere has the root's path but another mount.
            root = next(r for r in self._allowed if path.is_relative_to(r))
            allowed = mount_id(root)
            for f in plan.files:
                if not f.is_relative_to(root):
                    raise NotAllowed(
                        f"{path}: a file of this checkpoint resolves outside the allowed root "
                        f"{root} (a symlink?); engramd loads for workers only files inside it"
                    )
                if mount_id(f) != allowed:
                    raise NotAllowed(
                        f"{f} is on another mount than the allowed root {root} (a bind mount?); "
                        "engramd loads for workers only files on the root's own mount"
                    )
        if plan.set_id != set_id:
            # No set id here: a caller must not learn the id of files it cannot read.
            raise FingerprintDiffers(
                f"the daemon's copy of {path} differs from the worker's: the files' names, "
                "sizes, headers or data differ; give the daemon and the worker the same checkpoint"
            )

    def _under_root(self, path: Path) -> bool:
        return any(path.is_relative_to(r) for r in self._allowed)


#: The mode bits (owner, group, others) that let a user read a file, and search a folder.
READ = (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)
SEARCH = (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)


def _every_path_grants(
    files: Sequence[str], grants: Callable[[os.stat_result, tuple[int, int, int]], bool]
) -> bool:
    """True when `grants` allows reading each of `files` and searching every folder above it.

    Each folder is judged once, however many of the files it holds. Paths the
    daemon cannot stat count as closed; no files at all count as closed too.
    """
    judged: set[Path] = set()
    try:
        for name in files:
            path = Path(name)
            if not grants(os.stat(path), READ):
                return False
            for folder in path.parents:
                if folder in judged:
                    break  # its own parents were judged with it
                if not grants(os.stat(folder), SEARCH):
                    return False
                judged.add(folder)
    except OSError:
        return False
    return bool(files)


def open_to_group(files: list[str], gid: int | None) -> bool:
    """True when every member of group `gid` (any user in it) may read all of `files`.

    Judged from mode bits along each path: "other" bits, or group bits where
    the group is `gid`; owner bits and ACL entries for named users are left
    out, since the daemon cannot tell which member asks. Unreadable paths count
    as closed.
    """

    def grants(st: os.stat_result, bits: tuple[int, int, int]) -> bool:
        _, group, other = bits
        return bool(st.st_mode & other) or (
            gid is not None and st.st_gid == gid and bool(st.st_mode & group)
        )

    return _every_path_grants(files, grants)


def may_read(files: Sequence[str], uid: int, gids: Collection[int]) -> bool:
    """True when user `uid` with groups `gids` may read every one of `files`.

    Judged from mode bits along each path as the kernel judges plain modes:
    the owner's bits where the user owns the file or folder, else the
    group's where one of `gids` owns it, else the others'. ACL entries are
    not read (a named-user entry counts as closed). Root may read anything;
    paths the daemon cannot stat count as closed.
    """

    def grants(st: os.stat_result, bits: tuple[int, int, int]) -> bool:
        owner, group, other = bits
        if st.st_uid == uid:
            return bool(st.st_mode & owner)
        if st.st_gid in gids:
            return bool(st.st_mode & group)
        return bool(st.st_mode & other)

    return uid == 0 or _every_path_grants(files, grants)
