"""Lets PyPI's torchvision 0.28.0 import beside CPU torch; imported before any engine.

SGLang imports torchvision on the way to its Engram layer (configs ->
multimodal/internvl_utils.py; transformers' image utils too), vLLM on the
way to its Qwen4Exp model class (qwen3_5 -> qwen3_vl -> transformers'
image processing), which vLLM's model registry imports in a subprocess of
its own (tests/support/shims/sitecustomize.py declares the ops there). The only
torchvision that matches torch 2.13 on the package index is a CUDA build:
its `_C.so` needs libtorch_cuda.so, and `torchvision/_meta_registrations.py`
registers fakes for `torchvision::nms` / `qnms` without checking the ops
loaded. Declaring the two schemas lets the import finish; nothing on the
n-gram tables' path calls them. With a CUDA torch the real ops load, and nothing is declared.
"""

import contextlib

import torch


def declare() -> None:
    """Declare torchvision's two detection ops' schemas once (a second call is harmless)."""
    if torch.version.cuda is not None:
        return
    for op in ("nms", "qnms"):
        # RuntimeError: declared already in this process.
        with contextlib.suppress(RuntimeError):
            torch.library.define(
                f"torchvision::{op}",
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            )


declare()
