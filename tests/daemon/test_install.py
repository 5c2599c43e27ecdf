"""`pip install` of the wheel, as a new user or the Docker image does it: nothing from the tree.

The wheel is built from the checkout and installed into a fresh venv outside
it, beside this interpreter's own CPU torch (and what torch requires) linked
in: unpacking its 1 GB again took half of the test's time and tests nothing
of engramd's. Every module of both packages must import from that venv, and the
console script must synthesize, serve, report and share a checkpoint from
another folder. The packages expected are found in the source tree by
setuptools' own discovery, so a subpackage added later is expected too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from setuptools import find_packages

from conftest import mounted_tmpfs
from harness.daemon_process import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
#: Each import package, and the folder of the checkout it comes from.
SOURCES = {
    "engramd": ROOT / "engramd",
    "engramd_shared": ROOT / "engramd_shared",
    "engramd_client": ROOT / "client" / "engramd_client",
}
#: What a worker runs in the venv: attach shared, print where the client came from and digests.
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


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> str:
    """Run a command from `cwd` with no path into the checkout; its stdout, or the failure."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv outside the checkout with the wheel (and the pinned CPU torch) installed."""
    base = tmp_path_factory.mktemp("install")
    # A copy without build outputs: setuptools reuses a build/ folder left in
    # the tree, which can hold packages that the configuration leaves out.
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info"))
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        source,
        "-w",
        base / "dist",
        cwd=base,
    )
    (wheel,) = (base / "dist").glob("engramd_node-*.whl")
    run(sys.executable, "-m", "venv", base / "venv", cwd=base)
    link_installed("torch", next((base / "venv" / "lib").glob("python*/site-packages")))
    pip: list[str | Path] = [base / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    run(*pip, "--disable-pip-version-check", wheel, cwd=base)
    yield base / "venv"


def link_installed(name: str, site: Path, linked: set[str] | None = None) -> None:
    """Link the distribution `name` of this interpreter, and every one it requires (extras
    aside), into the site-packages folder `site`: its packages and its metadata, so that
    pip finds it installed."""
    linked = set() if linked is None else linked
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in linked:
        return
    linked.add(key)
    dist = importlib.metadata.distribution(name)
    base = Path(str(dist.locate_file("")))
    # Entries outside site-packages (console scripts under bin/) are not needed to import.
    tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    tops -= {"__pycache__"}
    if any(os.path.lexists(site / top) for top in tops):
        return  # the venv has its own (setuptools)
    for top in sorted(tops):
        (site / top).symlink_to(base / top)
    for requirement in dist.requires or ():
        if "extra ==" not in requirement:
            link_installed(re.split(r"[ <>=!~;\[(]", requirement, maxsplit=1)[0], site, linked)


def test_every_module_imports_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    modules = expected_modules()
    # The tree's packages as listed by setuptools, so the test cannot be blind to one.
    assert {"engramd.backings", "engramd.demo", "engramd.testing", "engramd_shared.pb"} <= set(
        modules
    )
    script = (
        "import importlib, json, sys\n"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))\n"
    )
    files = json.loads(run(venv / "bin" / "python", "-c", script, *modules, cwd=tmp_path))
    outside = {m: f for m, f in files.items() if not Path(f).is_relative_to(venv)}
    assert not outside, f"modules imported from outside the venv: {outside}"


def test_the_console_script_serves_a_checkpoint_from_another_folder(
    venv: Path, tmp_path: Path, sock_dir: Path
) -> None:
    engramd = venv / "bin" / "engramd"
    assert "serve" in run(engramd, "--help", cwd=tmp_path)
    checkpoint = tmp_path / "ckpt"
    run(engramd, "synth", checkpoint, "--rows", "20000", cwd=tmp_path)
    expected = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if ".engram.embed." in name:
                    data = st.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy()
                    expected[name] = hashlib.sha256(data.data).hexdigest()
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
                run(
                    venv / "bin" / "python",
                    "-c",
                    WORKER,
                    checkpoint,
                    sock_dir / "d.sock",
                    cwd=tmp_path,
                )
            )
        finally:
            daemon.stop()
    assert Path(worker["client"]).is_relative_to(venv)
    assert worker["mode"] == "shared"
    assert worker["digests"] == expected
