"""engramd's vLLM plugin: the n-gram tables vLLM keeps in host memory come from engramd.

vLLM loads it through its `vllm.general_plugins` entry point (name `engramd`)
in every process, possibly several times; `register` is that entry point.
With the daemon on the node, an unmodified `vllm serve` takes the tables it
keeps in host memory (`EngramConfig.cpu_offload`, the default) from the
daemon's one copy, for both families vLLM 0.33.0 ships:

- DeepSeek-V4.1's Engram tables (deepseek.py);
- Qwen4Exp's PLE n-gram table (qwen4exp.py).

Each family's module is patched right after vLLM imports it, so a model of
another family imports nothing of it. What both share (the decision, the
weight-loading hooks) is process.py; the guard of the version and seams is
guard.py.

ENGRAMD_SHARE: auto (engramd where it serves, else vLLM's own path with one
warning), on (strict: start-up fails with engramd's error), off (the plugin
stands aside). `--load-format dummy` writes the tables, so the plugin stands
aside for any load format but auto and safetensors.
"""

from __future__ import annotations

from engramd_client.engines.common import when_imported
from engramd_client.engines.vllm import deepseek, qwen4exp
from engramd_client.engines.vllm.guard import VLLM, vllm_version
from engramd_client.engines.vllm.process import WORKER_MODULE, install_step, log

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: harmless when called again, or without n-grams."""
    global _registered
    if _registered:
        return
    _registered = True
    if not VLLM.may_patch(vllm_version, log):
        return
    when_imported(deepseek.ENGRAM_MODULE, deepseek.install)
    when_imported(qwen4exp.PLE_MODULE, qwen4exp.install)
    when_imported(WORKER_MODULE, install_step)
