"""`engramd status`, `synth` (Engram and PLE checkpoints) and `demo` as an operator runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import Worker
from engramd.config import flags
from engramd.demo.run import TURNS
from engramd.testing.synth import PleSpec, expected_ple_rows, expected_rows
from engramd_client import attach
from engramd_shared.checkpoint import INDEX_FILE
from helpers import engramd


def test_status_json(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    w = Worker(checkpoint, d.socket, labels={"dp_rank": "3", "tp_rank": "0"})
    workers.append(w)
    result = engramd("status", "--socket", str(d.socket), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["daemon"]["pid"] == d.proc.pid
    assert doc["daemon"]["version"] and doc["daemon"]["uptime_s"] >= 0
    assert doc["shm"]["dir"] == str(d.shm_dir)
    assert doc["shm"]["total_bytes"] >= doc["shm"]["used_bytes"] > 0
    assert doc["shm"]["free_bytes"] > 0
    [s] = doc["sets"]
    assert s["checkpoint"] == str(checkpoint)
    assert s["bytes"] == 2 * 40_000 * (256 + 8)
    assert s["state"] == "ready" and s["adopted"] is False
    assert s["leases"] == [
        {
            "lease_id": w.hello["lease_id"],
            "pid": w.proc.pid,
            "labels": {"dp_rank": "3", "tp_rank": "0"},
            "attached_s": s["leases"][0]["attached_s"],
            # It collected its descriptors on the fd channel: the kernel named
            # its pid and uid there (SO_PEERCRED).
            "pid_verified": True,
            "uid": os.getuid(),
            "kind": "HANDLE_KIND_FD",
            # It asked for no CUDA device, so it reads the set on none.
            "device": "",
            "gpu_route": "GPU_ROUTE_UNSPECIFIED",
            "stale": False,
        }
    ]
    assert s["lease_count"] == 1

    text = engramd("status", "--socket", str(d.socket))
    assert text.returncode == 0
    assert s["set_id"] in text.stdout and "dp 3, tp 0" in text.stdout


def test_status_without_daemon_exits_1(sock_dir: Path) -> None:
    result = engramd("status", "--socket", str(sock_dir / "none.sock"))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "none.sock" in result.stderr


def test_synth_writes_what_the_reference_reader_reads(tmp_path: Path) -> None:
    out = tmp_path / "synth"
    result = engramd("synth", str(out), "--layers", "3", "--rows", "5000", "--shards", "2")
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / f))
    assert set(index["weight_map"]) == set(tensors)
    for layer in (1, 3, 5):
        w = tensors[f"layers.{layer}.engram.embed.weight"]
        s = tensors[f"layers.{layer}.engram.embed.scale"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == (5000, 256)
        assert s.dtype == torch.float8_e8m0fnu and s.shape == (5000, 8)
        rows = torch.arange(5000)
        assert torch.equal(w.view(torch.uint8), expected_rows(0, layer, "weight", rows, 256))
        assert torch.equal(s.view(torch.uint8), expected_rows(0, layer, "scale", rows, 8))
        assert not torch.isnan(w.float()).any()
    assert any(".engram." not in name for name in tensors)


def test_synth_writes_a_ple_checkpoint_a_daemon_serves_as_that_family(
    tmp_path: Path, daemons: Any
) -> None:
    out = tmp_path / "qwen4exp"
    args = ("--rows", "3000", "--format", "NVFP4", "--parts", "5", "--shards", "3")
    result = engramd("synth", str(out), "--family", "ple", *args)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}: 2 Qwen4Exp PLE layers (NVFP4, 5 row shards each)" in result.stdout
    # The tests' own generator wrote it: every row is the one it computes.
    spec = PleSpec(layers=(0, 2), rows=3000, fmt="NVFP4", parts=5, files=3)
    assert len(set(json.loads((out / INDEX_FILE).read_text())["weight_map"].values())) == 3
    d = daemons("--checkpoint", str(out))
    [s] = d.status().sets
    assert (s.family, s.state, s.tensors, s.bytes) == ("ple", "ready", 4, spec.table_bytes)
    tables = attach(out, share=True, socket=str(d.socket))
    try:
        assert tables.mode == "shared"
        for layer in spec.layers:
            for part in spec.widths():
                served = tables[f"{spec.table(layer)}.{part}"].view(torch.uint8)
                rows = torch.arange(spec.rows)
                assert torch.equal(served, expected_ple_rows(spec, layer, part, rows)), part
    finally:
        tables.close()
    # What only PLE checkpoints take is refused for Engram's, not ignored.
    refused = engramd("synth", str(tmp_path / "engram"), "--parts", "5")
    assert refused.returncode == 2 and "applies to --family ple only" in refused.stderr
    assert not (tmp_path / "engram").exists()


def demo_folders() -> set[Path]:
    """The demo's shm folders (others' runs may come and go in /dev/shm meanwhile)."""
    return set(Path("/dev/shm").glob("engramd-demo-*"))


def test_demo_runs_small_and_cleans_up(tmp_path: Path) -> None:
    before = demo_folders()
    result = engramd(
        "demo",
        "--rows",
        "20000",
        "--replicas",
        "2",
        "--steps",
        "2",
        "--tokens",
        "64",
        "--workdir",
        str(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lookups/s" in result.stdout and "all checks passed" in result.stdout
    assert demo_folders() == before
    # It says up front how long it takes, then shows each step of the long stretch.
    first, *lines = result.stdout.splitlines()
    assert first.startswith("engramd demo: 2 replicas") and " s on " in first, first
    assert [f"replica {r} attached in" in "\n".join(lines) for r in (0, 1)] == [True, True]
    # Five turns, each a shared replica's run and the private replica's, in alternating order.
    runs = [line for line in lines if " M lookups/s, 0 of " in line]
    assert len(runs) == 2 * TURNS, result.stdout
    order = ["private" in line for line in runs]
    assert order == [False, True, True, False, False, True, True, False, False, True], runs
    assert [f"replica {r}:" in "\n".join(runs) for r in (0, 1)] == [True, True]
    assert f"lookups/s (median of {TURNS} turns)" in result.stdout


def test_demo_ctrl_c_cleans_up(tmp_path: Path) -> None:
    before = demo_folders()
    demo = subprocess.Popen(
        [sys.executable, "-m", "engramd", "demo", "--rows", "20000", "--steps", "50"],
        stdout=subprocess.PIPE,
        text=True,
        # CI may start us with SIGINT ignored (a background job); a terminal would not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert demo.stdout is not None
    for line in demo.stdout:
        if "engramd loaded the set" in line:
            break
    children = psutil.Process(demo.pid).children(recursive=True)
    assert children, "the demo started no daemon"
    demo.send_signal(signal.SIGINT)
    assert demo.wait(timeout=60) == 130
    assert "interrupted" in demo.stdout.read()
    assert demo_folders() == before
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline() for c in alive]


def test_backing_names_are_the_registered_backings() -> None:
    # The CLI's help lists BACKING_NAMES without importing the backings.
    from engramd.backings import BACKINGS, COMBINED
    from engramd.values import BACKING_NAMES

    assert (*BACKINGS, *COMBINED) == BACKING_NAMES
    assert all(BACKINGS[name].name == name for name in BACKINGS)


def test_a_daemon_imports_only_its_backings(tmp_path: Path) -> None:
    # The backings' modules are imported when named: tmpfs alone, auto's pair, a
    # CUDA backing only when asked for.
    probe = (
        "import sys\n"
        "from engramd.backings import backings_for\n"
        "from engramd.config import DaemonConfig\n"
        "from engramd.host.fdstore import FdStore\n"
        "from engramd.host.sdnotify import Notifier\n"
        "from engramd.values import BackingSpec\n"
        "config = DaemonConfig(shm_dir=sys.argv[1], backing=BackingSpec(sys.argv[2]))\n"
        "backings_for(config, None, FdStore(Notifier(address=''), env={}))\n"
        "print(sorted(m.rpartition('.')[2] for m in sys.modules\n"
        "             if m.startswith('engramd.backings.')))\n"
    )
    shared = ["base", "handles"]
    for backing, modules in [("tmpfs", ["tmpfs"]), ("auto", ["memfd", "tmpfs"])]:
        result = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path), backing],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.stdout.split("\n")[0] == str(sorted([*shared, *modules])), result


#: The deploy files operators start from.
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`engramd serve` as an operator runs it; a wide terminal, so that no line wraps."""
    return subprocess.run(
        [sys.executable, "-m", "engramd", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400", **env},
    )


def test_serve_help_lists_every_setting_with_its_variable() -> None:
    shown = _serve("--help")
    assert shown.returncode == 0, shown.stderr
    for flag in flags():
        assert flag.option in shown.stdout and flag.env in shown.stdout, flag
        assert flag.setting.help.split(" (")[0] in shown.stdout, flag
    # Switches can be turned off, as the deploy files do.
    assert "--no-mlock" in shown.stdout and "--no-huge-tmpfs" in shown.stdout


def test_every_setting_is_a_config_file_key(tmp_path: Path) -> None:
    config = tmp_path / "engramd.toml"
    config.write_text("grace_s = 1.0\n")  # the field's old name; the key is the flag's
    refused = _serve("--config", str(config), "--socket", str(tmp_path / "x.sock"))
    assert refused.returncode == 2
    # The error's box wraps the list: its borders and breaks are no part of it.
    listed = refused.stderr.partition("(known: ")[2].partition(")")[0]
    known = "".join(c for c in listed if c not in "│ \n").split(",")
    assert {f.key for f in flags()} | {"log_level", "log_json"} == set(known)
    shipped = tomllib.loads((DEPLOY / "systemd" / "engramd.toml").read_text())
    assert {key.replace("-", "_") for key in shipped} <= set(known)


def test_settings_are_parsed_where_they_are_given(tmp_path: Path) -> None:
    # A flag, a variable and a --config value are refused alike, with the reason.
    config = tmp_path / "engramd.toml"
    config.write_text('memory-budget = "lots"\n')
    for refused, reason in [
        (_serve("--backing", "nvme"), "'nvme' is not a backing (known: tmpfs, hugetlbfs,"),
        (_serve(ENGRAMD_BACKING="memfd:1"), "only cuda-device takes a device"),
        (_serve("--numa", "node:4096"), "node 4096 has no memory"),
        (_serve("--page-size", "huge"), "'huge' is not a size"),
        (_serve("--config", str(config)), "'lots' is not a size"),
    ]:
        assert refused.returncode == 2 and reason in refused.stderr, refused.stderr


def test_commands_import_only_what_they_use(sock_dir: Path) -> None:
    # `--help`, `version` and `status` run without the daemon's modules (server,
    # backings) or torch; pydantic (typer 0.29's option coercion) stays out of
    # every command, the daemon's restart included.
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['engramd', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('engramd', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('engramd.lifecycle', 'engramd.api.server', 'engramd.backings', 'torch',\n"
        "         'pydantic')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    for args in (["--help"], ["version"], ["status", "--socket", str(sock_dir / "none.sock")]):
        result = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60
        )
        assert result.stderr.splitlines()[-1] == "[]", (args, result.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_demo_stopped_by_a_signal_leaves_nothing(sig: signal.Signals) -> None:
    """As `timeout`, a CI runner or a service manager stops it (SIGTERM), or a closed
    terminal (SIGHUP): mid-run, while replicas hold leases."""
    before = demo_folders()
    demo = subprocess.Popen(
        [sys.executable, "-m", "engramd", "demo", "--rows", "20000", "--steps", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None and demo.stderr is not None
    for line in demo.stdout:
        if "replica 0 attached in" in line:
            break
    children = psutil.Process(demo.pid).children(recursive=True)
    [daemon] = [c for c in children if "serve" in c.cmdline()]
    args = daemon.cmdline()
    sock_dir = Path(args[args.index("--socket") + 1]).parent
    shm = Path(args[args.index("--shm-dir") + 1])
    checkpoint = Path(args[args.index("--checkpoint") + 1])
    assert sock_dir.exists() and shm.exists() and checkpoint.exists()
    demo.send_signal(sig)
    assert demo.wait(timeout=60) == 128 + sig
    out, err = demo.stdout.read(), demo.stderr.read()
    assert f"stopped by {sig.name}" in out, out
    assert "Traceback" not in err, err
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline() for c in alive]
    assert demo_folders() == before
    assert not sock_dir.exists() and not checkpoint.exists()
    mounts = Path("/proc/self/mounts").read_text()
    assert str(shm) not in mounts
