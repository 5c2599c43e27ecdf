"""What one SGLang process decided and holds, whichever model family it builds.

SGLang's ranks are processes and it loads plugins once per process:
`PROCESS` is this process's one state. Its decision is one per TP group:
the group's rank 0 asks the daemon and SGLang's group broadcasts the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from engramd_client.engines.common import (
    CallThrough,
    Pattern,
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
from engramd_client.engines.sglang.guard import SGLANG, check_step_seams
from engramd_client.tables import Tables
from engramd_shared.checkpoint import is_store_url
from engramd_shared.errors import EngramdError
from engramd_shared.families import Family

#: Under SGLang's logger, so the plugin's lines appear in SGLang's log, formatted alike.
log = logging.getLogger("sglang.engramd")


@dataclass
class Process:
    """What this process decided and holds."""

    #: None until decided; then whether engramd serves this process's tables.
    serve: bool | None = None
    #: The checkpoint folder the tables come from.
    folder: str = ""
    #: The daemon's tables for this process's rows (kept for the process's life).
    tables: Tables | None = None
    #: The rows [start, stop) of each table this process holds (a range may run past the
    #: table's end: SGLang's padding).
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Each held table's rows in the checkpoint.
    table_rows: dict[str, int] = field(default_factory=dict)
    #: Checkpoint names of the tensors engramd serves here: SGLang's iterators skip them.
    served: frozenset[str] = frozenset()
    #: SGLang's weight iterators the plugin replaced, by name, to call through.
    iterators: dict[str, Callable[..., Any]] = field(default_factory=dict)
    #: SGLang's functions the plugin replaced on import (not through HookRegistry), to call.
    calls: CallThrough = field(default_factory=CallThrough)
    #: Where the held tables move at a step boundary (live tables); None until held.
    gate: StepGate | None = None

    def decide(
        self, family: Family, engine_tables: Pattern, own: str, group: Any = None, live: bool = True
    ) -> bool:
        """Whether engramd serves this process's `family` tables: once, the same on `group`.

        `engine_tables`: the checkpoint names SGLang loads as the family's
        tables; `own`: the tables SGLang allocates instead (for the warning);
        `group`: SGLang's GroupCoordinator whose ranks must agree (None: this
        process alone); `live`: the tables can be live (engramd's private copy serves
        while the daemon is down, common.settle).
        """
        if self.serve is not None:
            return self.serve
        from sglang.srt.runtime_context import get_model

        if not SGLANG.serves_load_format(str(get_model().load_format), log):
            self.serve = False
            return False

        def ask() -> None:
            probe(checkpoint_folder(), engine_tables, family.selection)

        refusal = decide(
            ask,
            leader=group is None or group.rank_in_group == 0,
            broadcast=None if group is None else lambda r: group.broadcast_object(r, src=0),
        )
        live = live and refusal is not None and _local_files()
        self.serve = settle(refusal, share_mode(), family.tables, engine_path(own), log, live)
        if self.serve:
            self.folder = checkpoint_folder()
        return self.serve

    def hold(self, tables: Tables, what: str) -> Tables:
        """Keep `tables` for the process's life; SGLang's iterators skip every tensor they hold."""
        self.tables = tables
        self.served = tables.checkpoint_names
        self.gate = StepGate(tables, _tp_group)
        serving(log, "SGLang", what, tables)
        return tables

    def step(self) -> bool:
        """Where SGLang starts a step on this rank: the held tables move if a move is due."""
        if self.gate is None or not self.gate.step():
            return False
        assert self.tables is not None
        moved(log, "SGLang", self.tables)
        return True


PROCESS = Process()


def _local_files() -> bool:
    """Whether the model's checkpoint is a folder here (engramd's private copy can be read)."""
    try:
        return not is_store_url(checkpoint_folder())
    except EngramdError:
        return False


def _tp_group() -> Any:
    """SGLang's TP group: its ranks' schedulers run every batch together."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.tp_group if parallel.tp_size > 1 else None


#: Where SGLang's ranks start a step (Scheduler.run_batch).
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def install_step(scheduler: ModuleType) -> None:
    """Call PROCESS.step() where SGLang's Scheduler runs a batch (before its own code)."""
    if replaced(scheduler.Scheduler.run_batch):
        return
    try:
        check_step_seams(scheduler)
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "step", "%s; live tables will not move", e)
        return
    PROCESS.calls.replace(scheduler.Scheduler, "run_batch", _run_batch)


def _run_batch(self: Any, batch: Any, pp_proxy_tensors: Any = None) -> Any:
    PROCESS.step()
    return PROCESS.calls.call(_run_batch, self, batch, pp_proxy_tensors)


def checkpoint_folder() -> str:
    """The folder of the model SGLang loads (a folder or a Hub id already cached), or the
    s3:// URL it streams the weights from (runai_streamer)."""
    from sglang.srt.runtime_context import get_model

    model = get_model()
    return local_folder(str(model.model_path), model.revision, model.download_dir)


def engine_path(own: str) -> str:
    """What runs instead of engramd (SGLang's `own` tables), and how to change that."""
    return (
        f"SGLang allocates its own {own}; start engramd on the node and mount its socket "
        "folder, or set ENGRAMD_SHARE=off to silence this"
    )


#: Where SGLang's ModelRunner updates its weights in place (its update_weights_* calls).
UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"


def install_updates(updater: ModuleType) -> None:
    """Refuse SGLang's weight updates that would write a served table (common.refuse_update),
    the way SGLang refuses its own: (False, why), nothing loaded.

    update_weights_from_disk and update_weights_from_ipc load whatever their files or
    handles hold (names unknown before they load); load_weights_from_distributed (the
    end of update_weights_from_distributed) and update_weights_from_tensor name theirs.
    """
    owner = updater.WeightUpdater
    for name, call, names in (
        ("update_weights_from_disk", "update_weights_from_disk", _unknown),
        ("update_weights_from_ipc", "update_weights_from_ipc", _unknown),
        ("load_weights_from_distributed", "update_weights_from_distributed", _named),
        ("update_weights_from_tensor", "update_weights_from_tensor", _named),
    ):
        own = getattr(owner, name, None)
        if own is not None and not replaced(own):
            PROCESS.calls.replace(owner, name, _guard(call, names))


def _unknown(*args: Any, **kwargs: Any) -> None:
    """An update whose weights' names are known only once it loads them."""
    return None


def _named(named_tensors: list[tuple[str, Any]], *args: Any, **kwargs: Any) -> list[str]:
    """The names of an update's (name, tensor) pairs."""
    return [name for name, _ in named_tensors]


def _guard(call: str, names: Callable[..., list[str] | None]) -> Callable[..., Any]:
    """SGLang's `call` in its place: (False, why) where it would write a served table (its
    weights' `names(*args, **kwargs)`), else SGLang's own."""

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        why = refuse_update("SGLang", call, names(*args, **kwargs), PROCESS.served)
        if why is not None:
            log.warning("%s", why)
            return False, why
        return PROCESS.calls.call(guarded, self, *args, **kwargs)

    return guarded
