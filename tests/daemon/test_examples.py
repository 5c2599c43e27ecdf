"""examples/: data-parallel replicas that attach and bind compute what private tables do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPLICA = Path(__file__).resolve().parents[2] / "examples" / "dp_replica.py"


def test_three_replicas_share_and_match_private_tables_bit_for_bit(
    checkpoint: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint))
    runs = [
        subprocess.Popen(
            [sys.executable, str(REPLICA), str(checkpoint), "--socket", str(d.socket), "--rank", r],
            env={**os.environ, "ENGRAMD_SHARE": share},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, share in (("0", "on"), ("1", "on"), ("2", "on"), ("3", "off"))
    ]
    reports = []
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0
        reports.append(json.loads(out))
    assert [r["mode"] for r in reports] == ["shared", "shared", "shared", "private"]
    assert {r["bound"] for r in reports} == {4}
    assert len({r["digest"] for r in reports}) == 1, reports
