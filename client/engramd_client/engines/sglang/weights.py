"""SGLang's safetensors weight iterators, made to skip the tensors engramd serves.

The iterators (ITERATORS) are replaced: through SGLang's HookRegistry where a family
registers its hooks when SGLang loads the plugin (DeepSeek-V4.1's Engram
tables), or when SGLang imports the model family's module (Qwen4Exp's PLE
tables: `install`). Once engramd serves a process's n-gram tables, each
served tensor is yielded as an empty meta tensor of the checkpoint's dtype
without being read, so SGLang's `load_weights` still routes it to the layer
(which keeps the daemon's copy: DeepSeek's `_load_rows`, or Qwen4Exp's row
copy of zero rows) and counts it loaded. Until then, and for reads that take
whole files anyway (runai_streamer's too: an s3:// model streamed from object
storage), SGLang's own iterator runs, its served tensors withheld from the layers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import say_once
from engramd_client.engines.sglang.process import PROCESS, log
from engramd_client.mapping import torch_dtype
from engramd_shared.errors import CheckpointError

WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
#: SGLang's model loader, which binds both iterators by name when it is imported.
LOADER = "sglang.srt.model_loader.loader"
ITERATORS = (
    "safetensors_weights_iterator",
    "buffered_multi_thread_safetensors_weights_iterator",
    # runai_streamer's (an s3:// model streamed from object storage): it streams whole files,
    # so its served tensors are read, and withheld from the layers.
    "runai_safetensors_weights_iterator",
)


def hooks(weight_utils: ModuleType) -> list[tuple[str, Callable[..., Any], str]]:
    """The hooks (target, hook, HookType name) of both iterators; SGLang's own are kept.

    Until a family's adapter holds tables (PROCESS.served), SGLang's own iterators run.
    """
    PROCESS.iterators = {name: getattr(weight_utils, name) for name in ITERATORS}
    return [
        (f"{WEIGHT_UTILS}.{name}", replacement, "REPLACE")
        for name, replacement in zip(ITERATORS, REPLACEMENTS, strict=True)
    ]


def install() -> None:
    """Replace both iterators now, where SGLang's model loader calls them; once per process.

    For a family patched when its model module is imported: SGLang's loader
    has imported the iterators by name by then, so its names are replaced too.
    """
    import importlib
    import sys

    if PROCESS.iterators:
        return
    weight_utils = importlib.import_module(WEIGHT_UTILS)
    PROCESS.iterators = {name: getattr(weight_utils, name) for name in ITERATORS}
    owners = [weight_utils]
    if LOADER in sys.modules:
        owners.append(sys.modules[LOADER])
    for owner in owners:
        for name, replacement in zip(ITERATORS, REPLACEMENTS, strict=True):
            if getattr(owner, name, None) is PROCESS.iterators[name]:
                PROCESS.calls.replace(owner, name, replacement)


def _placeholder(f: Any, name: str) -> torch.Tensor:
    """An empty meta tensor of the checkpoint's dtype and row width, read from the header only.

    Zero rows: a layer that copies rows from it copies none; the dtype is the
    checkpoint's, so SGLang's dtype checks see what it would have read.
    """
    part = f.get_slice(name)
    try:
        dtype = torch_dtype(part.get_dtype())
    except CheckpointError:
        dtype = torch.uint8
    return torch.empty((0, *part.get_shape()[1:]), dtype=dtype, device="meta")


def _skipping(
    files: list[str], workers: int, drop_cache_after_load: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's safetensors reads, file by file on `workers` threads, without the served tensors.

    Each served tensor is yielded as an empty meta tensor (`_placeholder`), never read.
    """
    import safetensors
    from sglang.srt.model_loader import weight_utils

    served = PROCESS.served

    def load(path: str) -> dict[str, torch.Tensor]:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            return {
                k: _placeholder(f, k) if k in served else f.get_tensor(k)
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


def _whole_files(disable_mmap: bool, prefetch: bool) -> bool:
    """Whether SGLang reads whole files here (its own iterator runs, the served tables too)."""
    if not (disable_mmap or prefetch):
        return False
    say_once(
        log,
        logging.WARNING,
        "whole-files",
        "SGLang reads whole checkpoint files here (disable_mmap or "
        "--weight-loader-prefetch-checkpoints), the n-gram tables engramd serves "
        "included; the layers keep engramd's copy",
    )
    return True


def _withheld(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's own reads with each served tensor replaced by an empty placeholder.

    The layers never write a served table, whose pages are read-only.
    """
    served = PROCESS.served
    for name, tensor in weights:
        if name in served:
            tensor = torch.empty((0, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
        yield name, tensor


def _safetensors_iterator(
    hf_weights_files: list[str],
    disable_mmap: bool = False,
    prefetch: bool = False,
    prefetch_num_threads: int = 4,
    drop_cache_after_load: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    original = PROCESS.iterators[ITERATORS[0]]
    if not PROCESS.served or _whole_files(disable_mmap, prefetch):
        own = original(
            hf_weights_files, disable_mmap, prefetch, prefetch_num_threads, drop_cache_after_load
        )
        return _withheld(own) if PROCESS.served else own
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
    if not PROCESS.served or _whole_files(disable_mmap, prefetch):
        own = original(
            hf_weights_files,
            max_workers,
            disable_mmap,
            prefetch,
            prefetch_num_threads,
            drop_cache_after_load,
        )
        return _withheld(own) if PROCESS.served else own
    return _skipping(list(hf_weights_files), max_workers, drop_cache_after_load)


def _runai_iterator(
    hf_weights_files: list[str], is_distributed: bool = False, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    original = PROCESS.iterators[ITERATORS[2]]
    own = original(hf_weights_files, is_distributed, device)
    if PROCESS.served:
        say_once(
            log,
            logging.INFO,
            "runai",
            "runai_streamer streams whole checkpoint files, the n-gram tables engramd serves "
            "included; the layers keep engramd's copy",
        )
        return _withheld(own)
    return own


#: The plugin's iterator for each of ITERATORS, in order.
REPLACEMENTS: tuple[Callable[..., Any], ...] = (
    _safetensors_iterator,
    _buffered_iterator,
    _runai_iterator,
)
