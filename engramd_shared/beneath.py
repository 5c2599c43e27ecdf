"""Files opened beneath a folder, never outside it, and held open while they matter.

A path a caller names is a claim: any component of it may be a symlink that
another user swaps between two looks at it. So a file is opened by walking
from a descriptor of the allowed root, one component at a time, each opened
without following it (openat2(2) with RESOLVE_BENEATH | RESOLVE_NO_XDEV where
the kernel has it, else openat(2) with O_NOFOLLOW and a check of the mount),
symlinks read and followed by the walk itself only while they stay beneath
the root. Nothing of a file is read before the walk has proven it lies
inside; what is read, proven and judged is the one descriptor the walk got
(`Opened`), with the folders it went through, all held open: a peer is later
judged against those very files (device, inode, mode), never a path again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engramd_shared.errors import CheckpointError, Reason

#: openat2(2)'s number on every Linux ABI engramd runs on (x86-64, arm64: the generic table).
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
#: As the kernel's own limit on symlinks followed in one lookup.
MAX_SYMLINKS = 40


class OutsideRoot(CheckpointError):
    """A path that leaves the folder it must stay beneath (a symlink, "..", another mount)."""

    reason = Reason.NOT_ALLOWED

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"{problem}; engramd loads and reads for workers only files inside its allowed "
            "roots: put the checkpoint's files there, or have the operator load it"
        )


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
#: None until the first walk asks the kernel; then whether openat2 works here.
_has_openat2: bool | None = None


class Held:
    """A descriptor held open for as long as anything refers to it; closed with its last holder."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def stat(self) -> os.stat_result:
        """The file as the kernel sees it now (it is the same file whatever its path became)."""
        return os.fstat(self.fd)

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close bound at definition: at interpreter exit the module may be gone.
        _close(self.fd)


@dataclass(frozen=True, eq=False)
class Opened:
    """A file (or folder) found by a walk beneath a root, held open."""

    #: Where the walk found it: the root's path and the components it followed.
    path: Path
    #: Its descriptor: read-only for a regular file, O_PATH for a folder.
    file: Held
    #: Every folder the walk went through, from "/" to the one that holds it.
    folders: tuple[Held, ...]

    @property
    def fd(self) -> int:
        """The file's descriptor."""
        return self.file.fd

    @property
    def magic(self) -> str:
        """A path the kernel resolves to this very file, whatever became of its name."""
        return f"/proc/self/fd/{self.fd}"

    def reopen(self) -> int:
        """A new read-only descriptor of this very file (an open file of its own: its own
        readahead); the caller closes it."""
        return os.open(self.magic, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


class Root:
    """A folder files are opened beneath; held open from when it is made."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # The root itself is the operator's: its own path may go through symlinks.
        self.path = Path(os.path.realpath(path))
        chain: list[Held] = []
        for folder in (*reversed(self.path.parents), self.path):
            chain.append(Held(os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)))
        self._chain = tuple(chain)
        self._mount = _mount_id(chain[-1].fd)

    def contains(self, path: Path) -> bool:
        """True when `path` (already normalized) names something beneath the root."""
        return path.is_relative_to(self.path)

    def open(self, path: Path, start: Opened | None = None, readable: bool = True) -> Opened:
        """Open `path` beneath the root: a regular file read-only, or a folder.

        `path` is absolute and beneath the root, or relative to `start` (a
        folder opened before). Raises OutsideRoot when the walk would leave
        the root or its mount, CheckpointError when it finds nothing usable.
        Not `readable`: a regular file too is held as O_PATH (to stat it).
        """
        if start is None:
            if not path.is_absolute() or not self.contains(path):
                raise OutsideRoot(f"{path} is outside the allowed root {self.path}")
            stack = [self._chain[-1]]
            where = [self.path]
            names = deque(path.relative_to(self.path).parts)
        else:
            stack = [*start.folders[len(self._chain) - 1 :], start.file]
            where = [start.path]
            names = deque(path.parts)
        links = 0
        found: Held | None = None
        while names:
            name = names.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) == 1:
                    raise OutsideRoot(f"{path} leads outside the allowed root {self.path} ('..')")
                stack.pop()
                where[0] = where[0].parent
                continue
            step = Held(self._step(stack[-1].fd, name, path))
            st = step.stat()
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    raise CheckpointError(f"{path}: too many symlinks (a loop?)")
                target = Path(os.readlink("", dir_fd=step.fd))
                if target.is_absolute():
                    # An absolute target is walked again from the root.
                    if not self.contains(Path(os.path.normpath(target))):
                        raise OutsideRoot(
                            f"{path}: a symlink in it leads outside the allowed root {self.path}"
                        )
                    stack, where = [self._chain[-1]], [self.path]
                    target = target.relative_to(self.path)
                names.extendleft(reversed(target.parts))
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(step)
                where[0] = where[0] / name
                found = None if names else step
                continue
            if names:
                raise CheckpointError(f"{path}: {where[0] / name} is not a folder")
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(
                    f"{path}: not a regular file (a FIFO, device or socket); a checkpoint is "
                    "made of regular safetensors files"
                )
            where[0] = where[0] / name
            found = step
        if found is None:
            # The root itself, or a path ending in "..": a folder.
            found = stack[-1]
        folders = (*self._chain[:-1], *stack)
        if found is stack[-1]:
            return Opened(where[0], found, folders[:-1])
        if not readable:
            return Opened(where[0], found, folders)
        # The walk's descriptor is O_PATH; reading needs one of the very same file.
        try:
            fd = os.open(f"/proc/self/fd/{found.fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise _cannot(path, e.errno) from None
        return Opened(where[0], Held(fd), folders)

    def _step(self, folder: int, name: str, path: Path) -> int:
        """An O_PATH descriptor of `name` in `folder`, never following it out of the mount."""
        global _has_openat2
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
        if _has_openat2 is not False:
            how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS)
            for _ in range(8):  # EAGAIN: a rename raced the lookup; the kernel asks to retry
                fd = _libc.syscall(
                    _SYS_OPENAT2, folder, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how)
                )
                if fd >= 0:
                    _has_openat2 = True
                    return int(fd)
                err = ctypes.get_errno()
                if err != errno.EAGAIN:
                    break
            if err in (errno.ENOSYS, errno.EPERM) and not _has_openat2:
                _has_openat2 = False  # an older kernel, or a seccomp filter that hides it
            elif err == errno.EXDEV:
                raise OutsideRoot(
                    f"{path}: {name} is on another mount than the allowed root {self.path} "
                    "(a bind mount?)"
                )
            else:
                raise _cannot(path, err)
        try:
            fd = os.open(name, flags, dir_fd=folder)
        except OSError as e:
            raise _cannot(path, e.errno) from None
        if _mount_id(fd) != self._mount:
            os.close(fd)
            raise OutsideRoot(
                f"{path}: {name} is on another mount than the allowed root {self.path} "
                "(a bind mount?)"
            )
        return fd

    def listdir(self, folder: Opened) -> list[str]:
        """The names in a folder opened beneath the root."""
        fd = os.open(f"/proc/self/fd/{folder.fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)


def _cannot(path: Path, err: int | None) -> CheckpointError:
    return CheckpointError(f"{path}: cannot read: {os.strerror(err or errno.EIO)}")


def _mount_id(fd: int) -> int:
    """The kernel's id of the mount that holds `fd` (differs across bind mounts)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(f"no mnt_id for descriptor {fd} in /proc/self/fdinfo")
