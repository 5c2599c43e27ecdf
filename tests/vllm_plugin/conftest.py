"""The vLLM plugin's fixtures (vllm_harness.py), and torchvision on CPU torch (tvshim.py)
in this process and every process it starts (vLLM's model registry inspects models in a
subprocess of its own)."""

import os
from pathlib import Path

import tvshim  # noqa: F401 (before vLLM imports torchvision)
from vllm_plugin.vllm_harness import model, ple_models, served, stored

SHIMS = Path(__file__).resolve().parent.parent / "support" / "shims"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SHIMS), *filter(None, [os.environ.get("PYTHONPATH")])]
)

__all__ = ["model", "ple_models", "served", "stored"]
