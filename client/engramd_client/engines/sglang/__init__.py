"""engramd's SGLang plugin: the n-gram tables SGLang keeps in host memory come from engramd.

SGLang loads it through its `sglang.srt.plugins` entry point (name
`engramd`) once per process, in every process of a server; `register` is
that entry point. It registers hooks, all through SGLang's own
HookRegistry, only for the families whose tables SGLang keeps in host
memory here:

- DeepSeek-V4.1's Engram host tables (deepseek.py,
  `SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE`);
- Qwen4Exp's PLE n-gram tables (qwen4exp.py, `--ple-offload-embedding`
  with the `pinned` backend): a server flag, not known when plugins load,
  so its module is patched when SGLang imports it (`when_imported`; SGLang
  imports its model modules as it resolves the architecture), not before;

and, for both, SGLang's safetensors iterators (weights.py), which skip
the tensors engramd serves. HookRegistry only logs a hook it cannot apply,
so every target and signature is checked first (guard.py): an SGLang whose
seams differ gets one warning and no hook.

ENGRAMD_SHARE: auto (engramd where it serves, else SGLang's own path with
one warning), on (strict: start-up fails with engramd's error), off (the
plugin stands aside). Load formats other than auto and safetensors (dummy
writes the tables) make the plugin stand aside.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from engramd_client.engines.common import UnknownEngine, say_once, when_imported
from engramd_client.engines.sglang import deepseek, qwen4exp, weights
from engramd_client.engines.sglang.guard import SGLANG, check_seams, sglang_version
from engramd_client.engines.sglang.process import (
    SCHEDULER_MODULE,
    UPDATER_MODULE,
    install_step,
    install_updates,
    log,
)

_registered = False


def register() -> None:
    """The `sglang.srt.plugins` entry point: registers the hooks, or nothing with a reason."""
    global _registered
    if _registered:
        return
    _registered = True
    if not SGLANG.may_patch(sglang_version, log):
        return
    when_imported(qwen4exp.QWEN4_EXP, qwen4exp.install)
    when_imported(SCHEDULER_MODULE, install_step)
    when_imported(UPDATER_MODULE, install_updates)
    from sglang.srt.environ import envs

    if not envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.get():
        # SGLang keeps the Engram tables in GPU memory: nothing to serve, nothing imported.
        return
    try:
        hooks = seams()
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, HookType[kind])
    log.debug("engramd's SGLang plugin registered %d hooks", len(hooks))


def seams() -> list[tuple[str, Callable[..., Any], str]]:
    """The hooks to register, (target, hook, HookType name), once every seam is checked."""
    try:
        engram, weight_utils, registry = (
            importlib.import_module(m)
            for m in (
                deepseek.ENGRAM_MODULE,
                weights.WEIGHT_UTILS,
                "sglang.srt.plugins.hook_registry",
            )
        )
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_model, get_parallel  # noqa: F401
    except ImportError as e:
        raise SGLANG.unknown(f"modules ({e})") from None
    check_seams(engram, weight_utils, registry, envs)
    return [*deepseek.seams(), *weights.hooks(weight_utils)]
