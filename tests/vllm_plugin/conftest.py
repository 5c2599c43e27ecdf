"""The vLLM plugin's fixtures (vllm_harness.py)."""

import tvshim  # noqa: F401 (before vLLM imports torchvision)
from vllm_plugin.vllm_harness import model, ple_models, served

__all__ = ["model", "ple_models", "served"]
