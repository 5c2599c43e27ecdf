"""`pip install` of the wheel, as a node, a new user or the Docker image does it: the daemon
with no torch, from nothing in the tree.

The wheel is built from the checkout and installed with its dependencies into a
fresh venv outside it (pip's cache makes that seconds after the first time):
engramd-node alone, which must bring no torch, so `import torch` fails there.
Every module of the daemon must import from that venv, and the console script
must serve a checkpoint from another folder and report it; the worker attaching
to it is the project's own venv, which has torch and the client, as an engine's
venv beside the daemon's would. NIXL installed with --no-deps (how a fleet node
without torch takes the `[fleet]` extra's one package) then gives a fill from a
peer between two daemons of that venv. The packages expected are found in the
source tree by setuptools' own discovery, so a subpackage added later is
expected too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from fleet_nodes import (
    Net,
    checkpoint_digests,
    nixl_missing,
    ready_set,
    receiving,
    serving,
    set_digests,
)
from setuptools import find_packages

from conftest import mounted_tmpfs
from harness.daemon_process import DaemonProcess
from helpers import reference_digests

ROOT = Path(__file__).resolve().parents[2]
#: Each import package, and the folder of the checkout it comes from.
SOURCES = {
    "engramd": ROOT / "engramd",
    "engramd_shared": ROOT / "engramd_shared",
    "engramd_client": ROOT / "client" / "engramd_client",
}
#: The packages that build torch tensors, as a worker does: they may need torch.
WORKER_SIDE = ("engramd_client", "engramd.demo", "engramd.testing")
#: What a worker runs from the project's venv: attach shared, print where the client came
#: from and digests.
WORKER = """
import hashlib, json, sys
import torch
import engramd_client
from engramd_client import attach

tables = attach(sys.argv[1], share=True, socket=sys.argv[2])
print(json.dumps({
    "client": engramd_client.__file__,
    "mode": tables.mode,
    "digests": {
        name: hashlib.sha256(tables[name].contiguous().view(torch.uint8).numpy().data).hexdigest()
        for name in tables
    },
}))
tables.close()
"""
#: Imports each module named; prints where each came from, and why each that failed did.
IMPORT_ALL = """
import importlib, json, sys
files, failed = {}, {}
for m in sys.argv[1:]:
    try:
        files[m] = importlib.import_module(m).__file__
    except ImportError as e:
        failed[m] = e.name
print(json.dumps({"files": files, "failed": failed, "torch": "torch" in sys.modules}))
"""


def expected_modules() -> list[str]:
    """Every module of both packages in the checkout (not `__main__`, which runs the CLI)."""
    modules = []
    for top, folder in SOURCES.items():
        for package in [top, *(f"{top}.{p}" for p in find_packages(folder))]:
            path = folder.joinpath(*package.split(".")[1:])
            modules.append(package)
            modules += [
                f"{package}.{f.stem}"
                for f in sorted(path.glob("*.py"))
                if f.stem not in ("__init__", "__main__")
            ]
    return modules


def outcome(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a command from `cwd` with no path into the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> str:
    """Run a command as `outcome` does; its stdout, or the failure."""
    done = outcome(*args, cwd=cwd, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv outside the checkout with the wheel and its dependencies: no torch."""
    base = tmp_path_factory.mktemp("install")
    # A copy without build outputs: setuptools reuses a build/ folder left in
    # the tree, which can hold packages that the configuration leaves out.
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info"))
    pip: list[str | Path] = [sys.executable, "-m", "pip"]
    quiet = ["-q", "--disable-pip-version-check"]
    run(*pip, "wheel", *quiet, "--no-deps", source, "-w", base / "dist", cwd=base)
    (wheel,) = (base / "dist").glob("engramd_node-*.whl")
    run(sys.executable, "-m", "venv", base / "venv", cwd=base)
    run(base / "venv" / "bin" / "python", "-m", "pip", "install", *quiet, wheel, cwd=base)
    yield base / "venv"


def test_the_daemon_installs_and_imports_without_torch(venv: Path, tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    missing = outcome(python, "-c", "import torch", cwd=tmp_path)
    assert missing.returncode != 0 and "No module named 'torch'" in missing.stderr
    modules = expected_modules()
    # The tree's packages as listed by setuptools, so the test cannot be blind to one.
    assert {"engramd.backings", "engramd.demo", "engramd.testing", "engramd_shared.pb"} <= set(
        modules
    )
    daemon = [m for m in modules if not any(m == w or m.startswith(w + ".") for w in WORKER_SIDE)]
    found = json.loads(run(python, "-c", IMPORT_ALL, *daemon, cwd=tmp_path))
    assert found["failed"] == {} and not found["torch"], found
    # The worker's side ships in the same wheel; here only its files are looked for (even
    # finding a module imports its package, which may need torch).
    (site,) = venv.glob("lib/python*/site-packages")
    for m in (m for m in modules if m not in daemon):
        path = site.joinpath(*m.split("."))
        package = path / "__init__.py"
        found["files"][m] = str(package if package.exists() else path.with_suffix(".py"))
    absent = [m for m, f in found["files"].items() if not Path(f).is_file()]
    assert not absent, f"modules missing from the venv: {absent}"
    assert set(found["files"]) == set(modules)
    outside = {m: f for m, f in found["files"].items() if not Path(f).is_relative_to(venv)}
    assert not outside, f"modules found outside the venv: {outside}"


def test_the_extras_bring_torch_to_workers_and_nixl_to_the_fleet(venv: Path) -> None:
    # What pip was told, read from the installed distribution's own METADATA.
    (site,) = venv.glob("lib/python*/site-packages")
    (dist,) = site.glob("engramd_node-*.dist-info")
    metadata = Parser().parsestr((dist / "METADATA").read_text())
    requires = metadata.get_all("Requires-Dist") or []
    torch = [r for r in requires if r.startswith("torch")]
    assert torch == ['torch<3,>=2.3; extra == "client"'], requires
    nixl = [r for r in requires if r.startswith("nixl")]
    assert nixl == ['nixl-cu12==1.5.1; extra == "fleet"'], requires
    for extra in ("vllm", "sglang", "dev"):
        assert f'engramd-node[client]; extra == "{extra}"' in requires, requires


def test_the_worker_side_commands_name_what_they_need(venv: Path, tmp_path: Path) -> None:
    for command in (["synth", str(tmp_path / "c")], ["demo"]):
        done = outcome(venv / "bin" / "engramd", *command, cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "pip install 'engramd-node[client]'" in done.stderr, done.stderr
    assert not (tmp_path / "c").exists()


def test_the_console_script_serves_a_checkpoint_to_a_worker_with_torch(
    venv: Path, tmp_path: Path, sock_dir: Path
) -> None:
    engramd = venv / "bin" / "engramd"
    assert "serve" in run(engramd, "--help", cwd=tmp_path)
    # Synthesized where torch is: the project's venv, as `engramd synth` runs on a worker.
    checkpoint = tmp_path / "ckpt"
    run(sys.executable, "-m", "engramd", "synth", checkpoint, "--rows", "20000", cwd=tmp_path)
    expected = reference_digests(checkpoint)
    assert expected, "engramd synth wrote no Engram tables"
    with mounted_tmpfs("64m") as shm:
        daemon = DaemonProcess(
            sock_dir / "d.sock",
            shm,
            ["--checkpoint", str(checkpoint), "--drop-on-exit"],
            sock_dir / "log",
            python=[str(venv / "bin" / "python")],
        )
        try:
            daemon.start()
            status = json.loads(
                run(engramd, "status", "--json", "--socket", sock_dir / "d.sock", cwd=tmp_path)
            )
            assert [s["checkpoint"] for s in status["sets"]] == [str(checkpoint)]
            worker = json.loads(
                run(sys.executable, "-c", WORKER, checkpoint, sock_dir / "d.sock", cwd=tmp_path)
            )
        finally:
            daemon.stop()
    assert Path(worker["client"]).is_relative_to(ROOT / "client")
    assert worker["mode"] == "shared"
    assert worker["digests"] == expected


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "-")
def test_nixl_without_its_torch_gives_a_fill_from_a_peer(
    venv: Path, net: Net, nodes: Any, checkpoint: Path, token_file: Path, tmp_path: Path
) -> None:
    python = venv / "bin" / "python"
    # requirements-nixl.txt with --no-deps, as docs/deploy.md gives it for a fleet node.
    pip: list[str | Path] = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(*pip, "--no-deps", "-r", ROOT / "requirements-nixl.txt", cwd=tmp_path)
    assert outcome(python, "-c", "import torch", cwd=tmp_path).returncode != 0
    a, b = nodes("a", python=str(python)), nodes("b", python=str(python))
    serving(a, checkpoint, net, token_file)
    rb = receiving(b, checkpoint, net, token_file)
    s = ready_set(rb)
    assert s.source == f"peer {net.ip_a}:7077", rb.log
    assert set_digests(b.shm_dir, s.set_id) == checkpoint_digests(checkpoint)
