"""vLLM's Engram lookup kernel on engramd's CUDA views equals it on vLLM's own pinned tables.

Needs a CUDA device and vLLM 0.33.0 importable (with its Triton); skipped
with the reason otherwise. Both sides are real vLLM ranks
(tests/vllm_plugin/vllm_rank.py, nothing replaced on a GPU): one with the
daemon serving (the layer's `_views` are engramd's CUDA views), one with
ENGRAMD_SHARE=off (vLLM's pinned tables, filled by its own weight loader).
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
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_plugin.vllm_harness import make_model

    return make_model(tmp_path_factory.mktemp("dsv41") / "ckpt")


def test_lookup_on_shared_tables_equals_vllms_own(
    vllm_model: Any, daemons: Any, tmp_path: Path
) -> None:
    from engine_harness import result
    from vllm_plugin.vllm_harness import run_ranks

    d = daemons("--checkpoint", str(vllm_model.folder))
    outputs = {}
    for mode in ("auto", "off"):
        folder = tmp_path / mode
        folder.mkdir()
        env = {"ENGRAMD_SOCKET": str(d.socket), "ENGRAMD_SHARE": mode}
        (done,) = run_ranks(vllm_model, 1, env, folder, ("--lookup", str(folder / "out.pt")))
        out = result(done)
        assert all(info["served"] == (mode == "auto") for info in out["layers"].values())
        outputs[mode] = torch.load(folder / "out.pt")
    assert outputs["auto"].keys() == outputs["off"].keys() and outputs["auto"]
    for name, shared in outputs["auto"].items():
        assert torch.equal(shared, outputs["off"][name]), name
        assert shared.abs().sum() > 0, name
