"""engramd's vLLM plugin: DeepSeek-V4.1's CPU-offloaded Engram tables come from engramd.

vLLM loads it through its `vllm.general_plugins` entry point (name `engramd`)
in every process, possibly several times; `register` is that entry point.
With the daemon on the node, an unmodified `vllm serve` takes every Engram
table it keeps in host memory (`EngramConfig.cpu_offload`, the default) from
the daemon's one copy: each layer's `weight` and `weight_scale_inv` are
read-only views of exactly the rows vLLM computed for the rank, the GPU
reads them through engramd's CUDA views, and no replica reads the tables
from the checkpoint. Tables vLLM keeps in GPU memory are left alone.

The seams, all in vLLM 0.33.0 (any other version: one warning, nothing
patched):

- `Engram._create_embedding` (around): which layer a table belongs to.
- `ParallelEngramEmbedding._allocate_weights` (replaced where engramd
  serves): the daemon's rows instead of pinned, THP or /dev/shm memory; the
  layer's `_views` / `_view_src` take engramd's CUDA views.
- `can_share_engram_tables` (as the DeepSeek-V4.1 models import it): with
  data-parallel replicas, the Engram DP group's leader asks the daemon and
  broadcasts the answer, so every rank agrees; "shared" when engramd serves.
- `weight_utils.should_skip_weight` (the safetensors iterators' filter): the
  served tensors are skipped before they are read.
- `DefaultModelLoader.track_weights_loading`: the served parameters count
  as loaded.

ENGRAMD_SHARE: auto (engramd where it serves, else vLLM's own path with one
warning), on (strict: start-up fails with engramd's error), off (the plugin
stands aside). `--load-format dummy` writes the tables, so the plugin stands
aside for any load format but auto and safetensors.

Qwen4Exp: vLLM 0.33.0 names its PLE n-gram shards in `_ENGRAM_WEIGHT_RE`
and `EngramConfig`, but ships no Qwen4Exp model, so no layer exists to
serve; a checkpoint holding such shards is refused by the selection check
(engramd's selection does not name them) and vLLM's own path runs.
"""

from __future__ import annotations

import contextvars
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from engramd_client.core.errors import CheckpointError
from engramd_client.engines.common import (
    Engine,
    Pattern,
    Refusal,
    UnknownEngine,
    attach_rows,
    decide,
    local_folder,
    params,
    probe,
    say_once,
    settle,
    share_mode,
    table_names,
)
from engramd_client.sharding import ceil_head_rows
from engramd_client.tables import Tables

#: Under vLLM's logger, so the plugin's lines appear in vLLM's log, formatted alike.
log = logging.getLogger("vllm.engramd")

#: vLLM as the guard names it, with the versions whose seams this plugin was written
#: against and tested with.
VLLM = Engine("vLLM", frozenset({"0.33.0"}))

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
#: The models that import `can_share_engram_tables` by name.
MODEL_MODULES = ("vllm.models.deepseek_v41.nvidia.model", "vllm.models.deepseek_v41.amd.model")
LOADER_MODULES = (
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.default_loader",
)

ENGINE_PATH = (
    "vLLM allocates its own Engram tables (as its dp_shared_memory / use_thp settings say); "
    "start engramd on the node and mount its socket folder, or set ENGRAMD_SHARE=off to "
    "silence this"
)

#: Marks a function this plugin put in vLLM's place.
_MARK = "__engramd__"


@dataclass
class _Process:
    """What this process decided and holds (one per process: vLLM's ranks are processes)."""

    #: None until decided; then whether engramd serves this process's Engram tables.
    serve: bool | None = None
    #: The checkpoint folder the tables come from.
    folder: str = ""
    #: The daemon's tables for this process's rows (kept for the process's life).
    tables: Tables | None = None
    #: Checkpoint names of the tensors engramd serves here: vLLM skips reading them.
    served: frozenset[str] = frozenset()
    #: vLLM's functions the plugin replaced, by name, to call through.
    original: dict[str, Callable[..., Any]] = field(default_factory=dict)
    #: vLLM's own pattern of Engram tables (`_ENGRAM_WEIGHT_RE`).
    pattern: Pattern | None = None


_state = _Process()
_registered = False
#: (layout, layer_hash_index) of the Engram layer whose table is being made.
_site: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "engramd_vllm_site", default=None
)


def register() -> None:
    """The `vllm.general_plugins` entry point: harmless when called again, or without Engram."""
    global _registered
    if _registered:
        return
    _registered = True
    if share_mode() is False:
        say_once(log, logging.INFO, "off", "ENGRAMD_SHARE=off: engramd's vLLM plugin stands aside")
        return
    try:
        VLLM.check_version(vllm_version())
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    # The Engram module is imported only for Engram models: patch it then, not before.
    when_imported(ENGRAM_MODULE, install)


def vllm_version() -> str:
    """The running vLLM's version (`vllm.version.__version__`)."""
    from vllm import version

    return str(version.__version__)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after `name` is executed, before its importers continue."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call `then(module)` once `name` is imported: now, if it is already."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def check_seams(engram: ModuleType, weight_utils: ModuleType, default_loader: ModuleType) -> None:
    """Raise UnknownEngine unless every signature and attribute the plugin relies on is there."""
    table = getattr(engram, "ParallelEngramEmbedding", None)
    layer = getattr(engram, "Engram", None)
    VLLM.expect(table is not None and layer is not None, "Engram module")
    assert table is not None and layer is not None
    VLLM.expect(params(layer._create_embedding) == ["self", "layout", "layer_hash_index"], "Engram")
    VLLM.expect(params(table._allocate_weights) == ["self"], "ParallelEngramEmbedding")
    names = set(table.__init__.__code__.co_names)
    needed = {"vocab_start_idx", "vocab_end_idx", "part_num_embeddings", "cpu_offload"}
    needed |= {"peer_rows", "dim", "block_size", "_views", "_view_src", "_get_shard_info"}
    needed |= {"_allocate_weights", "_weight_loader", "weight", "weight_scale_inv"}
    VLLM.expect(needed <= names, "ParallelEngramEmbedding attributes")
    VLLM.expect(
        {"_views", "_view_src", "_shared_memory"} <= set(table._storage.__code__.co_names),
        "ParallelEngramEmbedding._storage",
    )
    VLLM.expect(
        {"layer_ids", "primes"} <= set(engram.EngramLayout.__init__.__code__.co_names),
        "EngramLayout",
    )
    VLLM.expect(
        params(engram.can_share_engram_tables) == ["layout", "block_size"],
        "can_share_engram_tables",
    )
    VLLM.expect(
        callable(getattr(engram, "get_engram_dp_size", None))
        and callable(getattr(engram, "get_engram_dp_group", None)),
        "Engram DP group",
    )
    VLLM.expect(
        params(weight_utils.should_skip_weight) == ["weight_name", "local_expert_ids"]
        # Compiled with the `regex` package: anything with search() will do.
        and callable(getattr(getattr(weight_utils, "_ENGRAM_WEIGHT_RE", None), "search", None)),
        "weight_utils",
    )
    loader = getattr(default_loader, "DefaultModelLoader", None)
    VLLM.expect(
        loader is not None
        and params(loader.track_weights_loading)
        == ["self", "model", "loaded_weights", "quantized"],
        "DefaultModelLoader",
    )


def install(engram: ModuleType) -> None:
    """Put the plugin's functions in vLLM's place, all of them or (on a surprise) none."""
    if getattr(engram.ParallelEngramEmbedding._allocate_weights, _MARK, False):
        return
    weight_utils, default_loader = (importlib.import_module(m) for m in LOADER_MODULES)
    try:
        check_seams(engram, weight_utils, default_loader)
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    _state.pattern = weight_utils._ENGRAM_WEIGHT_RE
    loader = default_loader.DefaultModelLoader
    _replace(engram.Engram, "_create_embedding", _create_embedding)
    _replace(engram.ParallelEngramEmbedding, "_allocate_weights", _allocate_weights)
    _replace(loader, "track_weights_loading", _track_weights_loading)
    _replace(weight_utils, "should_skip_weight", _should_skip_weight)
    original = _replace(engram, "can_share_engram_tables", _can_share_engram_tables)
    for name in MODEL_MODULES:
        # Models imported before the plugin hold vLLM's function under their own name.
        model = sys.modules.get(name)
        if model is not None and getattr(model, "can_share_engram_tables", None) is original:
            setattr(model, "can_share_engram_tables", engram.can_share_engram_tables)  # noqa: B010
    log.debug("engramd's vLLM plugin is installed")


def _replace(owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[..., Any]:
    original = getattr(owner, name)
    _state.original[name] = original
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)
    return original


def _call(name: str, *args: Any, **kwargs: Any) -> Any:
    return _state.original[name](*args, **kwargs)


def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
    token = _site.set((layout, layer_hash_index))
    try:
        return _call("_create_embedding", self, layout, layer_hash_index)
    finally:
        _site.reset(token)


def _can_share_engram_tables(layout: Any, block_size: int = 32) -> bool:
    from vllm.models.deepseek_v41.common import engram

    if engram.get_engram_dp_size() > 1:
        group = engram.get_engram_dp_group()
        # Every rank of the group calls this at the same point of model
        # construction, as vLLM's own check does; the leader's answer goes to all.
        if _decide(leader=group.rank_in_group == 0, broadcast=group.broadcast_object):
            return True
    return bool(_call("can_share_engram_tables", layout, block_size))


def _checkpoint_folder(config: Any) -> str:
    model_config = config.model_config
    name = str(getattr(model_config, "model_weights", None) or model_config.model)
    return local_folder(name, model_config.revision, config.load_config.download_dir)


def _decide(
    leader: bool = True, broadcast: Callable[[Refusal | None], Refusal | None] | None = None
) -> bool:
    """Whether engramd serves this process's Engram tables (decided once per process)."""
    if _state.serve is not None:
        return _state.serve
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    load_format = str(config.load_config.load_format)
    if not VLLM.serves_load_format(load_format, log):
        _state.serve = False
        return False
    pattern = _state.pattern
    assert pattern is not None

    def ask() -> None:
        probe(_checkpoint_folder(config), pattern)

    refusal = decide(ask, leader=leader, broadcast=broadcast)
    _state.serve = settle(refusal, share_mode(), ENGINE_PATH, log)
    if _state.serve:
        _state.folder = _checkpoint_folder(config)
    return _state.serve


def layout_rows(layout: Any, head_rank: int, shards: int) -> dict[str, tuple[int, int]]:
    """Each Engram table's rows for head shard `head_rank` of `shards`, split as vLLM splits."""
    rows = {}
    for index, layer_id in enumerate(layout.layer_ids):
        heads = [size for order in layout.primes[index] for size in order]
        span = ceil_head_rows(heads, head_rank, shards)
        for name in table_names(layer_id):
            rows[name] = span
    return rows


def _attach(table: Any, layout: Any) -> Tables:
    from vllm.distributed import get_tensor_model_parallel_rank

    shards, head_rank = table._get_shard_info()
    device = None
    if torch.cuda.is_available():
        device = f"cuda:{torch.accelerator.current_device_index()}"
    labels = {"engine": "vllm", "tp_rank": str(get_tensor_model_parallel_rank())}
    strict = share_mode()
    tables = attach_rows(
        _state.folder,
        layout_rows(layout, head_rank, shards),
        # After the decision only engramd's own private copy may stand in: the
        # other ranks built their layers on engramd's answer.
        strict=True if strict else None,
        device=device,
        labels=labels,
    )
    _state.served = frozenset(tables)
    log.info(
        "engramd serves vLLM's Engram tables (%s, %d tensors, %.2f GiB of rows)",
        tables.mode,
        len(tables),
        tables.nbytes / 2**30,
    )
    return tables


def _allocate_weights(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    site = _site.get()
    if (
        site is None
        or not self.cpu_offload
        or self.peer_rows
        or torch.get_default_device().type == "meta"
        or not _decide()
    ):
        return _call("_allocate_weights", self)
    layout, index = site
    if _state.tables is None:
        _state.tables = _attach(self, layout)
    tables = _state.tables
    weight_name, scale_name = table_names(layout.layer_ids[index])
    weight = tables[weight_name]
    scale = tables[scale_name].view(torch.uint8)
    rows = self.vocab_end_idx - self.vocab_start_idx
    if (
        weight.dtype != torch.float8_e4m3fn
        or tuple(weight.shape) != (rows, self.dim)
        or tuple(scale.shape) != (rows, self.dim // self.block_size)
    ):
        raise CheckpointError(
            f"{weight_name} / {scale_name} of {_state.folder} are {weight.dtype} "
            f"{tuple(weight.shape)} / {tuple(scale.shape)} for vLLM's rows "
            f"{self.vocab_start_idx}..{self.vocab_end_idx}; vLLM's layer wants float8_e4m3fn "
            f"[{rows}, {self.dim}] and [{rows}, {self.dim // self.block_size}] bytes: the "
            "checkpoint does not match the model's config"
        )
    # The pages are the daemon's and read-only: nothing may write them.
    self._weight_loader = _served_weight_loader
    self._engramd_served = True
    if tables.device is not None:
        self._views = (tables.cuda(weight_name), tables.cuda(scale_name).view(torch.uint8))
        self._view_src = (weight.data_ptr(), scale.data_ptr())
    return weight, scale


def _served_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    # Reached only by iterators that ignore should_skip_weight (fastsafetensors,
    # multi-threaded loads): the bytes are the daemon's already.
    say_once(
        log,
        logging.INFO,
        "read",
        "this load format read an Engram table engramd serves from the checkpoint; the "
        "layer keeps engramd's copy (auto or safetensors loads skip reading it)",
    )


def _should_skip_weight(weight_name: str, local_expert_ids: set[int] | None) -> bool:
    if weight_name in _state.served:
        return True
    return bool(_call("should_skip_weight", weight_name, local_expert_ids))


def _track_weights_loading(
    self: Any, model: torch.nn.Module, loaded_weights: set[str] | None, quantized: bool = False
) -> None:
    if loaded_weights is not None:
        for name, module in model.named_modules():
            if getattr(module, "_engramd_served", False):
                for param, _ in module.named_parameters(prefix=name, recurse=False):
                    loaded_weights.add(param)
    _call("track_weights_loading", self, model, loaded_weights, quantized=quantized)
