"""The folders are the floors: who may import whom, read from the source's imports.

Every `import` and `from ... import` of both packages counts, those inside
functions too (a lazy import still ties the modules together).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "engramd": ROOT / "engramd",
    "engramd_shared": ROOT / "engramd_shared",
    "engramd_client": ROOT / "client" / "engramd_client",
}

#: The daemon's floors, lowest first: a module imports its own floor and those below.
FLOORS = [
    (
        "engramd.config",
        "engramd.values",
        "engramd.errors",
        "engramd.units",
        "engramd.text",
        "engramd.checksum",
        "engramd.strong",
    ),
    ("engramd.host",),
    ("engramd.backings",),
    ("engramd.sets",),
    ("engramd.api",),
    # Above the core, below the lifecycle that builds it (sets/seams.py: what it offers).
    ("engramd.fleet",),
    ("engramd.lifecycle",),
    ("engramd.cli", "engramd.demo", "engramd.testing", "engramd.__main__"),
]
#: Who outside the fleet may import it: the lifecycle builds it when a fleet flag is set, and
#: `engramd manifest` (the CLI) is the fleet's own command.
FLEET_BUILDERS = ("engramd.lifecycle", "engramd.cli.commands")
#: What the daemon and its workers agree on: both import it, it imports neither.
SHARED = "engramd_shared"
#: Where a worker runs, inside the daemon package: the demo's replicas use the
#: worker's library like any worker.
WORKER_SIDE = ("engramd.demo", "engramd.testing")


def module_name(path: Path) -> str:
    """`engramd.api.server` for engramd/api/server.py."""
    top = next(name for name, folder in SOURCES.items() if path.is_relative_to(folder))
    parts = [top, *path.relative_to(SOURCES[top]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of both packages (the generated stubs aside) by its dotted name."""
    found = {}
    for folder in SOURCES.values():
        for path in sorted(folder.rglob("*.py")):
            if "pb" not in path.relative_to(folder).parts:
                found[module_name(path)] = path
    return found


def imports(name: str, path: Path) -> Iterator[str]:
    """The absolute names of every module (or name in one) that `path` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


def typing_only(path: Path) -> set[str]:
    """The modules `path` imports only under `if TYPE_CHECKING:` (never at run time)."""
    found: set[str] = set()
    hinted: set[int] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                    found.add(stmt.module)
                    hinted.add(id(stmt))
    # A module imported at run time too is no hint alone.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in hinted:
            found.discard(node.module or "")
    return found


def within(name: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def floor_of(name: str) -> int:
    if name == "engramd":
        return 0  # the package itself: its version
    for i, floor in enumerate(FLOORS):
        if within(name, floor):
            return i
    raise AssertionError(f"{name} is on no floor: add it to FLOORS in {__file__}")


def resolve(target: str) -> str:
    """The module an imported name lives in (itself when it is one, or is outside)."""
    name = target
    while name and name not in ALL:
        name = name.rpartition(".")[0]
    return name or target


ALL = modules()
GRAPH = {name: {resolve(t) for t in imports(name, path)} for name, path in ALL.items()}


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("engramd.")))
def test_the_daemon_imports_only_down_and_never_the_worker_side(name: str) -> None:
    mine = floor_of(name)
    for target in GRAPH[name]:
        if target == "engramd" or target.startswith("engramd."):
            assert floor_of(target) <= mine, f"{name} imports {target} from a floor above"
        elif within(target, ["engramd_client"]):
            assert within(name, WORKER_SIDE), f"{name} imports the worker's {target}"
        assert not within(target, ["torch"]) or within(name, WORKER_SIDE), f"{name} imports torch"


@pytest.mark.parametrize("name", sorted(n for n in ALL if within(n, ["engramd.backings"])))
def test_the_backings_describe_handles_and_leave_the_wire_to_the_api(name: str) -> None:
    # Backings hand out plain descriptions (backings/handles.py); api/wire.py
    # alone turns them, and their kinds, into engramd.v1 messages.
    for target in imports(name, ALL[name]):
        assert not within(target, [f"{SHARED}.pb"]), f"{name} imports the wire's messages"


@pytest.mark.parametrize("name", sorted(n for n in ALL if within(n, ["engramd.sets"])))
def test_the_sets_take_plain_values_and_leave_the_wire_to_the_api(name: str) -> None:
    # The api/ builds the sets' values from messages (api/requests.py) and
    # messages from their answers (api/wire.py): a set's life never reads a stub.
    for target in imports(name, ALL[name]):
        assert not within(target, [f"{SHARED}.pb"]), f"{name} imports the wire's messages"


@pytest.mark.parametrize("name", sorted(n for n in ALL if within(n, [SHARED])))
def test_the_shared_package_stands_alone(name: str) -> None:
    for target in GRAPH[name]:
        assert not within(target, ["engramd", "engramd_client"]), f"{name} imports {target}"
        assert not within(target, ["torch"]), f"{name} imports torch"


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("engramd_client")))
def test_the_client_never_imports_the_daemon(name: str) -> None:
    for target in GRAPH[name]:
        assert not within(target, ["engramd"]), f"{name} imports the daemon ({target})"


@pytest.mark.parametrize(
    "name", sorted(n for n in ALL if n.startswith("engramd.") and not within(n, ["engramd.fleet"]))
)
def test_only_the_lifecycle_builds_the_fleet(name: str) -> None:
    # The core offers seams (engramd/sets/seams.py) and never reaches into the fleet.
    fleet = [t for t in GRAPH[name] if within(t, ["engramd.fleet"])]
    assert not fleet or name in FLEET_BUILDERS, f"{name} imports {fleet}"


@pytest.mark.parametrize("top", ["engramd", "engramd_client"])
def test_the_modules_import_one_another_without_a_circle(top: str) -> None:
    package = {n for n in ALL if n == top or n.startswith(top + ".")}
    edges = {
        n: {
            t
            for t in GRAPH[n]
            if t in package
            and t != n
            and not n.startswith(t + ".")
            # Imports for type hints alone are never run: modules may describe one another.
            and t not in typing_only(ALL[n])
        }
        for n in package
    }
    # Depth-first search; a module met again on the current path closes a circle.
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for target in sorted(edges[node]):
            visit(target, [*path, node])
        done.add(node)

    for node in sorted(package):
        visit(node, [])
