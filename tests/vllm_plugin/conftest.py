"""The vLLM plugin's fixtures (vllm_harness.py)."""

from vllm_plugin.vllm_harness import model, served

__all__ = ["model", "served"]
