"""What one vLLM process decided and holds, and the weight-loading hooks both families share.

vLLM's ranks are processes, and vLLM loads general plugins several times in
each: `PROCESS` is this process's one state, whichever model family it
builds. Its loader hooks make vLLM's safetensors iterators skip the tensors
engramd serves (`weight_utils.should_skip_weight`), withhold them from the
layers where an iterator reads them anyway (DefaultModelLoader's
multi-threaded and fastsafetensors iterators: `_get_weights_iterator`;
runai_streamer's, an s3:// model streamed from object storage:
`runai_streamer_loader.runai_safetensors_weights_iterator`), and count the
served parameters loaded (`DefaultModelLoader.track_weights_loading`). A
served table's rows are read-only here: a loader's copy into them would
fault.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import (
    CallThrough,
    Pattern,
    Refusal,
    ServedTableUpdate,
    StepGate,
    UnknownEngine,
    decide,
    local_folder,
    moved,
    probe,
    refuse_update,
    replaced,
    say_once,
    serving,
    settle,
    share_mode,
)
from engramd_client.engines.vllm.guard import VLLM, check_loader_seams, check_step_seams
from engramd_client.tables import Tables
from engramd_shared.checkpoint import is_store_url
from engramd_shared.errors import EngramdError
from engramd_shared.families import Family

#: Under vLLM's logger, so the plugin's lines appear in vLLM's log, formatted alike.
log = logging.getLogger("vllm.engramd")

LOADER_MODULES = (
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.model_loader.runai_streamer_loader",
)

#: Set on a layer whose tables engramd serves: its parameters count as loaded.
SERVED_MARK = "_engramd_served"


@dataclass
class Process:
    """What this process decided and holds."""

    #: None until decided; then whether engramd serves this process's tables.
    serve: bool | None = None
    #: The checkpoint folder the tables come from.
    folder: str = ""
    #: The daemon's tables for this process's rows (kept for the process's life).
    tables: Tables | None = None
    #: Checkpoint names of the tensors engramd serves here: vLLM skips reading them.
    served: frozenset[str] = frozenset()
    #: The rows [start, stop) of each table this process holds.
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: vLLM's functions the plugin replaced, to call through.
    calls: CallThrough = field(default_factory=CallThrough)
    #: vLLM's own pattern of n-gram table names (`_ENGRAM_WEIGHT_RE`).
    pattern: Pattern | None = None
    #: Where the held tables move at a step boundary (live tables); None until held.
    gate: StepGate | None = None

    def install_loader(self) -> bool:
        """Hook vLLM's weight loading once; False (one warning) where its seams differ."""
        weight_utils, default_loader, runai = (importlib.import_module(m) for m in LOADER_MODULES)
        if replaced(weight_utils.should_skip_weight):
            return True
        check_loader_seams(weight_utils, default_loader, runai)
        self.pattern = weight_utils._ENGRAM_WEIGHT_RE
        self.calls.replace(
            default_loader.DefaultModelLoader, "track_weights_loading", _track_weights_loading
        )
        self.calls.replace(weight_utils, "should_skip_weight", _should_skip_weight)
        self.calls.replace(
            default_loader.DefaultModelLoader, "_get_weights_iterator", _default_weights
        )
        self.calls.replace(runai, "runai_safetensors_weights_iterator", _runai_weights)
        return True

    def decide(
        self,
        family: Family,
        leader: bool = True,
        broadcast: Callable[[Refusal | None], Refusal | None] | None = None,
        engine_tables: Pattern | None = None,
        instead: Callable[[Any], str] | None = None,
    ) -> bool:
        """Whether engramd serves this process's `family` tables (decided once per process).

        The leader asks the daemon for the checkpoint's tables; `broadcast`
        (vLLM's collective) hands its answer to every rank of the group.
        `engine_tables`: the checkpoint names vLLM loads as the family's
        tables, where vLLM's own pattern does not name them all. `instead`:
        given vLLM's config where engramd does not serve (auto mode), what runs
        in its place, for the one warning (default: vLLM allocates its tables).
        """
        if self.serve is not None:
            return self.serve
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        if not VLLM.serves_load_format(str(config.load_config.load_format), log):
            self.serve = False
            return False
        pattern = engine_tables or self.pattern
        assert pattern is not None

        def ask() -> None:
            probe(checkpoint_folder(config), pattern, family.selection)

        refusal = decide(ask, leader=leader, broadcast=broadcast)
        path = engine_path(family)
        if refusal is not None and instead is not None and not share_mode():
            path = instead(config)
        # Rows read from the checkpoint's own files (ENGRAMD_DISK_OFFLOAD) allocate no table;
        # engramd's private live copy would: it serves only where vLLM's own path would run.
        live = (
            refusal is not None
            and path == engine_path(family)
            and _local_files(lambda: checkpoint_folder(config))
        )
        self.serve = settle(refusal, share_mode(), family.tables, path, log, live)
        if self.serve:
            self.folder = checkpoint_folder(config)
        return self.serve

    def hold(self, tables: Tables, what: str) -> Tables:
        """Keep `tables` for the process's life; vLLM's loader skips every tensor they hold."""
        self.tables = tables
        self.served = tables.checkpoint_names
        self.gate = StepGate(tables, _world_group)
        serving(log, "vLLM", what, tables)
        return tables

    def step(self) -> bool:
        """Where vLLM starts a step on this rank: the held tables move if a move is due."""
        if self.gate is None or not self.gate.step():
            return False
        assert self.tables is not None
        moved(log, "vLLM", self.tables)
        return True


PROCESS = Process()


def _local_files(folder: Callable[[], str]) -> bool:
    """Whether the model's checkpoint is a folder here (engramd's private copy can be read)."""
    try:
        return not is_store_url(folder())
    except EngramdError:
        return False


def _world_group() -> Any:
    """vLLM's group of every rank of this engine (TP and PP): they all run each step."""
    from vllm.distributed import get_world_group

    return get_world_group()


#: Where vLLM's ranks start a step (Worker.execute_model and execute_dummy_batch).
WORKER_MODULE = "vllm.v1.worker.gpu_worker"


def install_step(gpu_worker: ModuleType) -> None:
    """Call PROCESS.step() where vLLM's Worker starts a step (before its own code); guard
    its weight updates (install_updates)."""
    install_updates(gpu_worker)
    if replaced(gpu_worker.Worker.execute_model):
        return
    try:
        check_step_seams(gpu_worker)
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "step", "%s; live tables will not move", e)
        return
    PROCESS.calls.replace(gpu_worker.Worker, "execute_model", _execute_model)
    PROCESS.calls.replace(gpu_worker.Worker, "execute_dummy_batch", _execute_dummy_batch)


def install_updates(gpu_worker: ModuleType) -> None:
    """Refuse vLLM's weight updates that would write a served table (common.refuse_update).

    Worker.reload_weights puts every layer on the meta device and copies the reloaded
    weights back into the old storage (model_loader/reload/layerwise.py), a served
    table's read-only pages among them; Worker.update_weights hands each weight transfer
    engine the names it loads (ipc, nccl: model.load_weights; m2n: straight into the
    parameters' storage).
    """
    for name, guard in (("reload_weights", _reload_weights), ("update_weights", _update_weights)):
        own = getattr(gpu_worker.Worker, name, None)
        if own is not None and not replaced(own):
            PROCESS.calls.replace(gpu_worker.Worker, name, guard)


def _reload_weights(self: Any, *args: Any, **kwargs: Any) -> None:
    why = refuse_update("vLLM", "reload_weights", None, PROCESS.served)
    if why is not None:
        raise ServedTableUpdate(why)
    PROCESS.calls.call(_reload_weights, self, *args, **kwargs)


def _update_weights(self: Any, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
    why = refuse_update("vLLM", "update_weights", update_names(update_info), PROCESS.served)
    if why is not None:
        raise ServedTableUpdate(why)
    PROCESS.calls.call(_update_weights, self, update_info)


def update_names(update_info: Any) -> set[str] | None:
    """The weight names of an update_weights request (one rank's dict, or every rank's);
    None where one carries none (a transfer engine whose names are unknown here)."""
    infos = update_info if isinstance(update_info, list) else [update_info]
    names: set[str] = set()
    for info in infos:
        if not isinstance(info, dict) or not isinstance(info.get("names"), list):
            return None
        names.update(str(n) for n in info["names"])
    return names


def _execute_model(self: Any, scheduler_output: Any) -> Any:
    PROCESS.step()
    return PROCESS.calls.call(_execute_model, self, scheduler_output)


def _execute_dummy_batch(self: Any) -> None:
    PROCESS.step()
    PROCESS.calls.call(_execute_dummy_batch, self)


def engine_path(family: Family) -> str:
    """What runs instead of engramd, and how to change that, for the one warning."""
    return (
        f"vLLM allocates its own {family.tables} (as its dp_shared_memory / use_thp "
        "settings say); start engramd on the node and mount its socket folder, or set "
        "ENGRAMD_SHARE=off to silence this"
    )


def checkpoint_folder(config: Any) -> str:
    """The folder of the model vLLM loads (its weights folder or a Hub id already cached), or
    the s3:// URL it streams the weights from (runai_streamer)."""
    model_config = config.model_config
    name = str(getattr(model_config, "model_weights", None) or model_config.model)
    return local_folder(name, model_config.revision, config.load_config.download_dir)


def cuda_device() -> str | None:
    """The CUDA device this rank computes on, for the tables' CUDA views; None without one."""
    if torch.cuda.is_available():
        return f"cuda:{torch.accelerator.current_device_index()}"
    return None


def tp_labels() -> dict[str, str]:
    """The lease's labels in `engramd status`: the engine, its version and this rank's TP rank."""
    from importlib.metadata import version

    from vllm.distributed import get_tensor_model_parallel_rank

    return {
        "engine": "vllm",
        "engine_version": version("vllm"),
        "tp_rank": str(get_tensor_model_parallel_rank()),
    }


def served_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """A served layer's weight loader: the bytes are the daemon's already.

    Reached only through loaders whose iterators the plugin does not filter
    (neither DefaultModelLoader's nor runai_streamer's).
    """
    _read_served()


def _read_served() -> None:
    say_once(
        log,
        logging.INFO,
        "read",
        "this load format read a table engramd serves from the checkpoint; the layer keeps "
        "engramd's copy (auto or safetensors loads skip reading it)",
    )


def _withheld(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name in PROCESS.served:
            _read_served()
            continue
        yield name, tensor


def _default_weights(self: Any, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """DefaultModelLoader's weights of `source`, the tensors engramd serves withheld: its
    safetensors iterators skip them already; its multi-threaded and fastsafetensors ones
    read them."""
    return _withheld(PROCESS.calls.call(_default_weights, self, source))


def _runai_weights(
    hf_weights_files: list[str], use_tqdm_on_load: bool, is_distributed: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """runai_streamer's iterator, the tensors engramd serves withheld: it streams whole
    files."""
    return _withheld(
        PROCESS.calls.call(_runai_weights, hf_weights_files, use_tqdm_on_load, is_distributed)
    )


def _should_skip_weight(weight_name: str, local_expert_ids: set[int] | None) -> bool:
    if weight_name in PROCESS.served:
        return True
    return bool(PROCESS.calls.call(_should_skip_weight, weight_name, local_expert_ids))


def _track_weights_loading(
    self: Any, model: torch.nn.Module, loaded_weights: set[str] | None, quantized: bool = False
) -> None:
    if loaded_weights is not None:
        for name, module in model.named_modules():
            for param in getattr(module, SERVED_MARK, ()):
                loaded_weights.add(f"{name}.{param}" if name else param)
    PROCESS.calls.call(_track_weights_loading, self, model, loaded_weights, quantized=quantized)
