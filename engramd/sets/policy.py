"""Which loads a worker's attach may start: allowed roots, mounts, the selection.

Workers may make the daemon read files and hold memory; the operator's
configuration says which. Every check resolves paths first (symlinks, "..")
and judges the files the daemon would really read.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from engramd.config import DaemonConfig
from engramd.sets.intents import AttachIntent
from engramd_shared.beneath import Opened, Root
from engramd_shared.checkpoint import INDEX_FILE, TablePlan, is_store_url
from engramd_shared.errors import (
    CheckpointError,
    FingerprintMismatch,
    InvalidRequest,
    NotAllowed,
    SelectionRefused,
)
from engramd_shared.families import AUTO, FAMILIES


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
        # A store's URL names no path here (its set is attached by id).
        self._configured = {
            str(Path(p).resolve()) for p in config.checkpoints if not is_store_url(p)
        }

    def check_request(self, request: AttachIntent, loaded: list[str]) -> tuple[Path, Root | None]:
        """The checkpoint a worker may have loaded, and the root its files are opened beneath
        (None: a configured checkpoint); raises the refusal otherwise.

        `loaded` are the checkpoints of the sets the daemon holds.
        """
        self.selection(request)
        beneath = self.beneath(request.checkpoint)
        if beneath is not None:
            return beneath
        path = resolve(request.checkpoint)
        if str(path) in loaded:
            # The worker's files are not the ones the daemon loaded from this
            # path: the checkpoint changed on disk, or the worker sees other
            # files there. Never hand out the old bytes.
            raise FingerprintMismatch(
                f"the checkpoint at {path} is not the one engramd loaded from there: it changed "
                f"on disk, or the worker sees other files there; `engramd load {path}` loads the "
                "new version, or give the daemon and the worker the same files"
            )
        if str(path) not in self._configured:
            raise NotAllowed(self._refusal(request.checkpoint))
        return path, None

    def selection(self, request: AttachIntent) -> str:
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

    def check_read(self, checkpoint: str) -> tuple[Path, Root | None]:
        """The checkpoint and its root (as for a load), if the daemon may read it for a worker.

        Proving a worker's copy reads its files in full, as a load would: the
        same roots apply, and its files are opened beneath them.
        """
        beneath = self.beneath(checkpoint)
        if beneath is not None:
            return beneath
        path = resolve(checkpoint)
        if str(path) not in self._configured:
            roots = ", ".join(map(str, self._allowed)) or "none"
            raise NotAllowed(
                f"engramd holds this set from other files than {checkpoint}, and may not read "
                f"{checkpoint} to compare it (allowed roots: {roots}); attach with the checkpoint "
                "the operator loaded, or start the daemon with --allow-root <dir>"
            )
        return path, None

    def beneath(self, checkpoint: str) -> tuple[Path, Root] | None:
        """The checkpoint's path and the allowed root it names a place under; None: none.

        Judged on the path as written ("." and ".." taken away), never by
        following it: the walk beneath the root follows its symlinks, and
        only while they stay inside.
        """
        if not checkpoint.startswith("/"):
            return None
        path = Path(os.path.normpath(checkpoint))
        for allowed in self._allowed:
            if path.is_relative_to(allowed):
                try:
                    return path, Root(allowed)
                except OSError as e:
                    raise NotAllowed(
                        f"the allowed root {allowed} cannot be opened ({e.strerror}); the "
                        "operator should make it or change --allow-root"
                    ) from None
        return None

    def _refusal(self, checkpoint: str) -> str:
        # The path as the worker wrote it: where it leads is not the worker's to learn.
        roots = ", ".join(map(str, self._allowed)) or "none"
        return (
            f"engramd may not load {checkpoint} for a worker (allowed roots: {roots}); start the "
            f"daemon with --checkpoint {checkpoint} or --allow-root <dir>"
        )

    @staticmethod
    def check_plan(path: Path, plan: TablePlan, set_id: str) -> None:
        """Refuse a plan whose set is not the one the worker named.

        Its files lie inside their root: the walk that opened them proved it
        (engramd_shared.beneath), symlinks, ".." and bind mounts included.
        """
        if plan.set_id != set_id:
            # No set id here: a caller must not learn the id of files it cannot read.
            raise FingerprintMismatch(
                f"the daemon's copy of {path} differs from the worker's: the files' names, "
                "sizes, headers or data differ; give the daemon and the worker the same checkpoint"
            )


#: The mode bits (owner, group, others) that let a user read a file, and search a folder.
READ = (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)
SEARCH = (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)


def _every_path_grants(
    files: Sequence[str | Opened], grants: Callable[[os.stat_result, tuple[int, int, int]], bool]
) -> bool:
    """True when `grants` allows reading each of `files` and searching every folder above it.

    A file the daemon holds open (`Opened`) is judged by its descriptors: the
    file itself and each folder its walk went through, as they are now,
    whatever their names became. A path is judged by stat'ing it and its
    folders, each folder once, however many of the files it holds. Paths the
    daemon cannot stat count as closed; no files at all count as closed too.
    """
    judged: set[Path] = set()
    try:
        for item in files:
            if isinstance(item, Opened):
                if not grants(item.file.stat(), READ):
                    return False
                if not all(grants(folder.stat(), SEARCH) for folder in item.folders):
                    return False
                continue
            path = Path(item)
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


def open_to_group(files: Sequence[str | Opened], gid: int | None) -> bool:
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


def checkpoint_open_to_group(path: Path, beneath: Root, gid: int | None) -> bool:
    """True when every member of group `gid` may list the checkpoint at `path` and read each
    of its files, as a walk beneath `beneath` finds them (reading none of their bytes).

    What such a member could learn by itself (names, sizes, types, bytes) an
    error may tell; of any other checkpoint, an error on the worker socket
    (which cannot tell who asks) names nothing. Unusable counts as closed.
    """
    try:
        top = beneath.open(path, readable=False)
        items: list[str | Opened] = [top]
        if stat.S_ISDIR(top.file.stat().st_mode):
            for name in beneath.listdir(top):
                if name == INDEX_FILE or name.endswith(".safetensors"):
                    # A FIFO or a symlink out of the root shows as such in a listing.
                    with contextlib.suppress(CheckpointError):
                        items.append(beneath.open(Path(name), top, readable=False))
    except (OSError, CheckpointError):
        return False
    return open_to_group(items, gid)


def may_read(files: Sequence[str | Opened], uid: int, gids: Collection[int]) -> bool:
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
