"""SGLang's safetensors weight iterators, made to skip the tensors engramd serves.

Both iterators are replaced through SGLang's HookRegistry. Once engramd
serves a process's n-gram tables, each served tensor is yielded as an empty
meta tensor without being read, so SGLang's `load_weights` still routes it
to the layer's `_load_rows` (which keeps the daemon's copy) and counts it
loaded. Until then, and for reads that take whole files anyway, SGLang's
own iterator runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import say_once
from engramd_client.engines.sglang.process import PROCESS, log

WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
ITERATORS = ("safetensors_weights_iterator", "buffered_multi_thread_safetensors_weights_iterator")


def hooks(weight_utils: ModuleType) -> list[tuple[str, Callable[..., Any], str]]:
    """The hooks (target, hook, HookType name) of both iterators; SGLang's own are kept.

    Until a family's adapter holds tables (PROCESS.served), SGLang's own iterators run.
    """
    PROCESS.iterators = {name: getattr(weight_utils, name) for name in ITERATORS}
    return [
        (f"{WEIGHT_UTILS}.{ITERATORS[0]}", _safetensors_iterator, "REPLACE"),
        (f"{WEIGHT_UTILS}.{ITERATORS[1]}", _buffered_iterator, "REPLACE"),
    ]


def _skipping(
    files: list[str], workers: int, drop_cache_after_load: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's safetensors reads, file by file on `workers` threads, without the served tensors.

    Each served tensor is yielded as an empty meta tensor, never read.
    """
    import safetensors
    from sglang.srt.model_loader import weight_utils

    served = PROCESS.served

    def load(path: str) -> dict[str, torch.Tensor]:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            return {
                k: torch.empty(0, device="meta") if k in served else f.get_tensor(k)
                for k in f.keys()  # noqa: SIM118 (safe_open is no mapping)
            }

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: collections.deque[tuple[str, concurrent.futures.Future[Any]]] = collections.deque()
        queue = iter(files)
        for path in queue:
            pending.append((path, pool.submit(load, path)))
            if len(pending) > workers:
                break
        while pending:
            path, future = pending.popleft()
            tensors = future.result()
            following = next(queue, None)
            if following is not None:
                pending.append((following, pool.submit(load, following)))
            yield from sorted(tensors.items())
            del tensors
            if drop_cache_after_load:
                weight_utils._drop_file_cache_after_load(path)


def _reads_served(disable_mmap: bool, prefetch: bool) -> bool:
    """Whether SGLang's own iterator must run: nothing served, or reads that cannot skip."""
    if not PROCESS.served:
        return True
    if disable_mmap or prefetch:
        say_once(
            log,
            logging.WARNING,
            "whole-files",
            "SGLang reads whole checkpoint files here (disable_mmap or "
            "--weight-loader-prefetch-checkpoints), the Engram tables engramd serves "
            "included; the layers keep engramd's copy",
        )
        return True
    return False


def _safetensors_iterator(
    hf_weights_files: list[str],
    disable_mmap: bool = False,
    prefetch: bool = False,
    prefetch_num_threads: int = 4,
    drop_cache_after_load: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    original = PROCESS.iterators[ITERATORS[0]]
    if _reads_served(disable_mmap, prefetch):
        return original(
            hf_weights_files, disable_mmap, prefetch, prefetch_num_threads, drop_cache_after_load
        )
    return _skipping(list(hf_weights_files), 1, drop_cache_after_load)


def _buffered_iterator(
    hf_weights_files: list[str],
    max_workers: int,
    disable_mmap: bool = False,
    prefetch: bool = False,
    prefetch_num_threads: int = 4,
    drop_cache_after_load: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    original = PROCESS.iterators[ITERATORS[1]]
    if _reads_served(disable_mmap, prefetch):
        return original(
            hf_weights_files,
            max_workers,
            disable_mmap,
            prefetch,
            prefetch_num_threads,
            drop_cache_after_load,
        )
    return _skipping(list(hf_weights_files), max_workers, drop_cache_after_load)
