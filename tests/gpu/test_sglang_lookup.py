"""SGLang's Engram lookup kernel on engramd's CUDA views equals it on SGLang's own host table.

Needs a CUDA device and SGLang 0.5.23 importable (with its Triton); skipped
with the reason otherwise. Both sides are real SGLang ranks
(tests/sglang_plugin/sglang_rank.py, nothing replaced on a GPU), per-rank
host layout: one with the daemon serving (the layer's `_host_table_ptrs`
are engramd's CUDA views), one with ENGRAMD_SHARE=off (SGLang's own private
table, registered with cudaHostRegister and filled by its weight loader).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_views import GPU_ONLY

pytestmark = [
    *GPU_ONLY,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"
    ),
]


@pytest.fixture(scope="module")
def sglang_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from sglang_plugin.sglang_harness import make_model

    return make_model(tmp_path_factory.mktemp("dsv41") / "ckpt")


def test_lookup_on_shared_tables_equals_sglangs_own(
    sglang_model: Any, daemons: Any, tmp_path: Path
) -> None:
    from engine_harness import result
    from sglang_plugin.sglang_harness import run_ranks

    d = daemons("--checkpoint", str(sglang_model.folder))
    outputs = {}
    for mode in ("auto", "off"):
        folder = tmp_path / mode
        folder.mkdir()
        env = {"ENGRAMD_SOCKET": str(d.socket), "ENGRAMD_SHARE": mode}
        (done,) = run_ranks(sglang_model, 1, env, folder, ("--lookup", str(folder / "out.pt")))
        out = result(done)
        assert all(info["served"] == (mode == "auto") for info in out["layers"].values())
        outputs[mode] = torch.load(folder / "out.pt")
    assert outputs["auto"].keys() == outputs["off"].keys() and outputs["auto"]
    for layer, shared in outputs["auto"].items():
        assert torch.equal(shared, outputs["off"][layer]), layer
        assert shared.abs().sum() > 0, layer
