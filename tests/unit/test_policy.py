"""Which checkpoints a worker's attach may load (engramd.sets.policy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engramd.config import DaemonConfig
from engramd.sets.intents import AttachIntent
from engramd.sets.policy import LoadPolicy
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import FingerprintMismatch, NotAllowed, SelectionRefused


def test_load_policy(checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    policy = LoadPolicy(DaemonConfig(allow_roots=[str(root)], checkpoints=[str(checkpoint)]))
    inside = AttachIntent(set_id="0" * 20, checkpoint=str(root / "m"))
    path, beneath = policy.check_request(inside, loaded=[])
    # Under a root: the path as written, its files to be opened beneath that root.
    assert path == root / "m" and beneath is not None and beneath.path == root
    with pytest.raises(SelectionRefused):
        policy.check_request(
            AttachIntent(set_id="0" * 20, checkpoint=str(root / "m"), tensors="*"), []
        )
    with pytest.raises(NotAllowed, match="allowed roots"):
        policy.check_request(
            AttachIntent(set_id="0" * 20, checkpoint=str(tmp_path / "elsewhere")), []
        )
    # A configured checkpoint whose files differ from the loaded copy: changed on disk.
    configured = AttachIntent(set_id="0" * 20, checkpoint=str(checkpoint))
    with pytest.raises(FingerprintMismatch, match="changed on disk"):
        policy.check_request(configured, loaded=[str(checkpoint.resolve())])
    plan = plan_tables(checkpoint)
    policy.check_plan(checkpoint.resolve(), plan, plan.set_id)
    with pytest.raises(FingerprintMismatch) as info:
        policy.check_plan(checkpoint.resolve(), plan, "1" * 20)
    assert plan.set_id not in str(info.value)
