"""The daemon's image (deploy/docker/Dockerfile) built and run as deploy/docker/compose.yaml
runs it: the daemon in one container (its image without torch), an engine's worker in
another (its user, `group_add`, the socket volume, each in a pid namespace of its own)
attaching shared, the healthcheck answering.

No registry is needed: the base is made here with debootstrap from the mirror apt uses,
with the host's CA certificates and pip configuration (pip in the build reaches the
index the way the host does), imported with podman and kept (with its rootfs under
.tools/image/) for the next run, as the built image's layers are (earlier builds' are
pruned); the worker's image (the Dockerfile's `client` target) takes torch from the
wheel `pip download` finds for this machine. Containers and
volumes are removed after. runc runs them: crun refuses hybrid cgroups. The ulimits are
given together, within the host's hard limits: podman's defaults (and compose's
`memlock: -1`) exceed what an unprivileged container host allows.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import wait_until
from helpers import reference_digests

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
COMPOSE = ROOT / "deploy" / "docker" / "compose.yaml"
TOOLS = ROOT / ".tools" / "image"
BASE = "localhost/engramd-base:bookworm"
IMAGE = "localhost/engramd:test-image"
#: The worker's image: the client library and torch.
CLIENT = f"{IMAGE}-client"
TORCH = "torch==2.13.0"
#: What the base holds: the runtime stage's python3 with venv, and pip for the wheel stage.
DEBOOTSTRAP = [
    "debootstrap",
    "--variant=minbase",
    "--include=python3,python3-venv,python3-pip,ca-certificates",
    "bookworm",
]
PODMAN = ["podman", "--runtime", "runc"]


def _missing() -> str:
    if os.geteuid() != 0:
        return "building and running images with podman needs root"
    tools = [t for t in ("podman", "debootstrap", "runc") if shutil.which(t) is None]
    if tools:
        return f"{', '.join(tools)} missing: `make test-tools` as root installs them"
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")


def _run(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(args)}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
    return done.stdout


def _mirror() -> str:
    """The Debian mirror apt uses here (deb822 sources, else sources.list)."""
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        if m := re.search(r"^URIs:\s*(\S+/debian)/?$", sources.read_text(), re.M):
            return m[1]
    listed = Path("/etc/apt/sources.list")
    if listed.exists() and (m := re.search(r"^deb\s+(\S+/debian)/?\s", listed.read_text(), re.M)):
        return m[1]
    return "http://deb.debian.org/debian"


def _base() -> None:
    """The base image: bookworm's minbase, the host's CA certificates and pip configuration."""
    if subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    rootfs = TOOLS / "rootfs"
    if not rootfs.exists():
        partial = TOOLS / "rootfs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        _run(*DEBOOTSTRAP, str(partial), _mirror(), timeout=900)
        shutil.rmtree(partial / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        partial.rename(rootfs)
    for conf in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf", "/etc/xdg/pip"):
        if os.path.isdir(conf):
            shutil.copytree(conf, f"{rootfs}{conf}", dirs_exist_ok=True)
        elif os.path.exists(conf):
            os.makedirs(os.path.dirname(f"{rootfs}{conf}"), exist_ok=True)
            shutil.copy(conf, f"{rootfs}{conf}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["podman", "import", "-", BASE], stdin=tar.stdout, capture_output=True, text=True
    )
    tar.wait()
    assert imported.returncode == 0 and tar.returncode == 0, imported.stderr


def _torch_wheel() -> Path:
    """The torch wheel pip finds for this machine (a local file where there is one)."""
    wheels = TOOLS / "wheels"
    found = sorted(wheels.glob("torch-*.whl"))
    if not found:
        _run(sys.executable, "-m", "pip", "download", TORCH, "--no-deps", "-d", str(wheels))
        found = sorted(wheels.glob("torch-*.whl"))
    assert found, f"pip download {TORCH} left no wheel in {wheels}"
    return found[-1]


def _index() -> str:
    """The index this machine's pip uses (torch's own dependencies come from it)."""
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
    )
    return configured.stdout.strip() or "https://pypi.org/simple"


@pytest.fixture(scope="module")
def image() -> str:
    """The daemon image, built from the Dockerfile on the local base (and the worker's
    image, CLIENT, beside it)."""
    TOOLS.mkdir(parents=True, exist_ok=True)
    _base()
    wheel = _torch_wheel()
    started = int(time.time())
    build = [
        *PODMAN,
        "build",
        "--file",
        str(ROOT / "deploy" / "docker" / "Dockerfile"),
        "--build-arg",
        f"BASE={BASE}",
        "--build-arg",
        f"WHEEL_BASE={BASE}",
        "--build-arg",
        f"TORCH=/wheels/{wheel.name}",
        "--build-arg",
        f"TORCH_INDEX={_index()}",
        "--volume",
        f"{wheel.parent}:/wheels:ro",
    ]
    # The wheel stage tagged too, so that both stay the next build's cache.
    _run(*build, "--target", "wheel", "--tag", f"{IMAGE}-wheel", str(ROOT), timeout=900)
    _run(*build, "--target", "client", "--tag", CLIENT, str(ROOT), timeout=900)
    _run(*build, "--tag", IMAGE, str(ROOT), timeout=900)
    # Earlier builds' stages, untagged by now.
    _run("podman", "image", "prune", "--force", "--filter", f"until={started}")
    return IMAGE


#: The containers' process limit, where the host's is higher (runc is refused the host's own).
NPROC = 4096


def _ulimits() -> list[str]:
    """nofile, nproc and memlock, together, within the host's hard limits (compose's
    `memlock: -1` is refused where the host's is lower; CAP_IPC_LOCK locks the tables)."""
    args = []
    for name, which, most in (
        ("nofile", resource.RLIMIT_NOFILE, None),
        ("nproc", resource.RLIMIT_NPROC, NPROC),
        ("memlock", resource.RLIMIT_MEMLOCK, None),
    ):
        hard = resource.getrlimit(which)[1]
        if most is not None and (hard == resource.RLIM_INFINITY or hard > most):
            hard = most
        value = -1 if hard == resource.RLIM_INFINITY else hard
        args += ["--ulimit", f"{name}={value}:{value}"]
    return args


@pytest.fixture
def pair() -> Iterator[str]:
    """A suffix for this test's containers and socket volume; they are removed after."""
    suffix = f"{os.getpid()}-{secrets.token_hex(3)}"
    yield suffix
    for name in (f"engramd-{suffix}", f"engine-{suffix}"):
        subprocess.run(["podman", "rm", "--force", "--time", "5", name], capture_output=True)
    subprocess.run(
        ["podman", "volume", "rm", "--force", f"engramd-socket-{suffix}"], capture_output=True
    )


def _volumes(service: dict[str, Any], suffix: str, models: Path) -> list[str]:
    """The service's volumes: the named socket volume (this test's), /models (the test's)."""
    args = []
    for volume in service["volumes"]:
        source, _, target = volume.partition(":")
        if source == "engramd-socket":
            args += ["--volume", f"engramd-socket-{suffix}:{target}"]
        else:
            assert source == "/models", volume
            args += ["--volume", f"{models}:{target}"]
    return args


def test_the_image_serves_a_worker_in_another_container_as_compose_runs_them(
    image: str, pair: str, open_dirs: tuple[Path, Path, Path]
) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    daemon, engine = compose["services"]["engramd"], compose["services"]["engine"]
    top, _, ckpt = open_dirs
    # compose's checkpoint, /models/DeepSeek-V4.1-Flash, is this test's synthetic one.
    models = top / "models"
    models.mkdir()
    [configured] = [a.split("=", 1)[1] for a in daemon["command"] if a.startswith("--checkpoint")]
    ckpt.rename(models / Path(configured).name)
    models.chmod(0o755)
    ckpt = models / Path(configured).name

    health = daemon["healthcheck"]["test"]
    assert health[0] == "CMD"
    _run(
        *PODMAN,
        "run",
        "--detach",
        "--name",
        f"engramd-{pair}",
        *(f"--cap-add={cap}" for cap in daemon["cap_add"]),
        *_ulimits(),
        *_volumes(daemon, pair, models),
        "--health-cmd",
        shlex.join(health[1:]),
        # Run by the test below: podman's own timer needs systemd.
        "--health-interval",
        "disable",
        image,
        *daemon["command"],
    )
    healthcheck = ["podman", "healthcheck", "run", f"engramd-{pair}"]
    wait_until(
        lambda: subprocess.run(healthcheck, capture_output=True).returncode == 0,
        120,
        "the daemon container's healthcheck",
    )
    status = json.loads(
        _run("podman", "exec", f"engramd-{pair}", "engramd", "status", "--json", *health[3:])
    )
    [s] = status["sets"]
    assert s["state"] == "ready" and s["backing"] == "memfd", status

    # The daemon's image has no torch (nor the worker's side of engramd with it).
    no_torch = subprocess.run(
        [
            *PODMAN,
            "run",
            "--rm",
            *_ulimits(),
            "--entrypoint",
            "python3",
            image,
            "-c",
            "import torch",
        ],
        capture_output=True,
        text=True,
    )
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, no_torch

    # The engine, as compose runs it: its user, group_add, environment and volumes; the
    # worker's script in place of vLLM, in the worker's image (the client library, torch).
    user = engine["user"]
    worker = subprocess.run(
        [
            *PODMAN,
            "run",
            "--rm",
            "--interactive",
            "--name",
            f"engine-{pair}",
            "--user",
            user,
            *(f"--group-add={g}" for g in engine["group_add"]),
            *(f"--env={k}={v}" for k, v in engine["environment"].items()),
            *_ulimits(),
            *_volumes(engine, pair, models),
            "--volume",
            f"{SUPPORT}:/support:ro",
            "--entrypoint",
            "python3",
            CLIENT,
            "/support/worker.py",
            configured,
            "--socket",
            engine["environment"]["ENGRAMD_SOCKET"],
            "--share",
            "on",
        ],
        input="",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert worker.returncode == 0, worker.stderr
    hello = json.loads(worker.stdout.splitlines()[0])
    logs = _run("podman", "logs", f"engramd-{pair}")
    assert hello["mode"] == "shared", (hello, worker.stderr, logs)
    assert hello["set_id"] == s["set_id"]
    assert hello["digests"] == reference_digests(ckpt)
    assert "fd channel: refused" not in logs

    for built in (image, CLIENT):
        size = int(_run("podman", "image", "inspect", "--format", "{{.Size}}", built))
        print(f"{built}: {size / 1e9:.2f} GB")
