"""Run a script or module as another user, after importing it as root.

    python tests/support/run_as.py USER[:GROUP[:GIDS]] (SCRIPT.py | -m MODULE) [ARGS...]

A fresh clone (and its .venv, and often the interpreter itself) lives where
other users cannot enter (under /root), so the test user could not even
start this checkout's interpreter. Run as root instead, import what the
target needs, then drop to the user (supplementary groups, gid, uid: in that
order, since each step needs the privilege the next one gives up) before the
target touches a socket or a table. From then on the kernel judges the test
user. Modules imported later (error paths import lazily) are still found:
every import folder is opened before the drop and named by its
/proc/self/fd link, which the kernel follows without checking the folders
above it.

USER is a name (its primary group and supplementary groups are used) or a
numeric uid; GROUP, when given, is a numeric gid and the only group;
USER:GROUP:GIDS gives the supplementary groups (comma-separated gids) as
`setpriv --groups` does, whatever the group database says.
"""

from __future__ import annotations

import builtins
import ctypes
import importlib
import importlib.util
import os
import pwd
import sys
from types import CodeType
from typing import Any

PR_SET_DUMPABLE = 4

# What the test workers and the CLI import, also lazily: after the drop the
# interpreter may no longer be able to read its own packages.
PRELOAD = (
    "psutil",
    "torch",
    "grpc",
    "engramd_client.share",
    "engramd.cli.commands",
    "engramd.lifecycle",
    "engramd.cli.status_view",
    "engramd.testing.synth",
)


def keep_imports_reachable() -> None:
    """Point the module search path, and every imported package's, at /proc/self/fd links."""
    links: dict[str, str] = {}

    def link(folder: str) -> str:
        if folder not in links:
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return folder
            links[folder] = f"/proc/self/fd/{fd}"
        return links[folder]

    sys.path[:] = [link(p) if p else p for p in sys.path]
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            module.__path__ = [link(p) for p in path]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def drop_to(spec: str) -> None:
    """Become `spec` (a user name, or uid[:gid[:supplementary gids]]) for good."""
    name, _, group = spec.partition(":")
    group, _, extra = group.partition(":")
    if name.isdigit():
        uid = int(name)
        gid = int(group) if group else uid
        groups = [gid]
    else:
        entry = pwd.getpwnam(name)
        uid, gid = entry.pw_uid, int(group) if group else entry.pw_gid
        groups = [gid] if group else os.getgrouplist(name, gid)
    if extra:
        groups = [int(g) for g in extra.split(",")]
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    # A change of credentials makes /proc/self root's; the fd links need it ours.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.environ["USER"] = name
    os.environ["HOME"] = "/"


def compile_target(target: str, rest: list[str]) -> tuple[CodeType, dict[str, Any], list[str]]:
    """(code, its globals, argv) of `SCRIPT.py ARGS` or `-m MODULE ARGS`, read now."""
    if target != "-m":
        with open(target) as f:
            code = compile(f.read(), target, "exec")
        return code, {"__name__": "__main__", "__file__": target}, [target, *rest]
    module, *rest = rest
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        module = f"{module}.__main__"
        spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None or spec.origin is None:
        sys.exit(f"no module {module}")
    code = spec.loader.get_code(module)  # type: ignore[attr-defined]
    scope = {"__name__": "__main__", "__file__": spec.origin, "__package__": spec.parent}
    return code, scope, [spec.origin, *rest]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    user, target, *rest = sys.argv[1:]
    code, scope, argv = compile_target(target, rest)
    for name in PRELOAD:
        importlib.import_module(name)
    keep_imports_reachable()
    drop_to(user)
    sys.argv = argv
    exec(code, {**scope, "__builtins__": builtins})


if __name__ == "__main__":
    main()
