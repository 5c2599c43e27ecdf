"""What every engine adapter does the same way, whatever the engine.

- Which tensors: the daemon's selection, which must name exactly the tensors
  the engine's own pattern of Engram tables names in the checkpoint.
- Whether engramd serves: one answer for a group of ranks that must agree
  (the leader asks the daemon, the engine's own collective hands the answer
  to the others), or each process's own where nothing has to agree.
- The share mode (ENGRAMD_SHARE): auto, on (strict: the engine fails to
  start with engramd's error) or off (the adapter stands aside).
- The one warning, naming the cause and the fix, when engramd cannot serve
  and the engine keeps its own tables.
- The compatibility guard: the engine's version and the signatures the
  adapter relies on, checked before anything is patched.
- The import hook that patches an engine module right after it is imported
  (`when_imported`), and the engine functions an adapter replaced, kept to
  call through (`CallThrough`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch

from engramd_client.mapping import RowRanges
from engramd_client.tables import Tables
from engramd_shared import errors
from engramd_shared.checkpoint import checkpoint_files, is_store_url
from engramd_shared.config import ClientConfig
from engramd_shared.errors import CheckpointError, EngramdError, SelectionRefused, ShareError
from engramd_shared.headers import read_header

if TYPE_CHECKING:
    from engramd_client.share import TableInfo

#: Load formats whose weights go through the engines' safetensors iterators, which the
#: adapters make skip the served tensors; others (dummy writes the tables) are not served,
#: but where an adapter says more (Engine.formats).
SERVED_LOAD_FORMATS = frozenset({"auto", "safetensors"})

_said: set[str] = set()


class UnknownEngine(Exception):
    """The running engine is not the one an adapter's seams were read from."""


@dataclass(frozen=True)
class Engine:
    """An engine as its adapter's guard names it, for the one warning that disables the adapter."""

    #: As the engine spells itself ("vLLM", "SGLang").
    name: str
    #: The versions whose seams the adapter was written against and tested with.
    known: frozenset[str]
    #: The load formats it serves.
    formats: frozenset[str] = SERVED_LOAD_FORMATS

    def _disabled(self) -> str:
        return f"it is disabled and {self.name} allocates its own Engram tables"

    def check_version(self, version: str) -> None:
        """Raise UnknownEngine, with the fix, for a version the adapter does not know."""
        if version not in self.known:
            raise UnknownEngine(
                f"engramd's {self.name} plugin knows {self.name} "
                f"{', '.join(sorted(self.known))}, not {version}: {self._disabled()}; run a "
                f"known {self.name} or an engramd that knows this one"
            )

    def serves_load_format(self, load_format: str, log: logging.Logger) -> bool:
        """Whether the adapter serves a load of this format; one line where it stands aside."""
        if load_format in self.formats:
            return True
        say_once(
            log,
            logging.INFO,
            "format",
            "--load-format %s: engramd's %s plugin stands aside (it serves %s loads)",
            load_format,
            self.name,
            ", ".join(sorted(self.formats)),
        )
        return False

    def may_patch(self, version: Callable[[], str], log: logging.Logger) -> bool:
        """Whether the plugin may patch this engine: not ENGRAMD_SHARE=off, a known version.

        Where it may not, one line says why.
        """
        if share_mode() is False:
            say_once(
                log,
                logging.INFO,
                "off",
                "ENGRAMD_SHARE=off: engramd's %s plugin stands aside",
                self.name,
            )
            return False
        try:
            self.check_version(version())
        except UnknownEngine as e:
            say_once(log, logging.WARNING, "unknown", "%s", e)
            return False
        return True

    def unknown(self, what: str) -> UnknownEngine:
        """The error for a seam (`what` of the engine) that is not as the adapter knows it."""
        return UnknownEngine(
            f"engramd's {self.name} plugin does not recognise this {self.name}'s {what}: "
            f"{self._disabled()}; run {self.name} {', '.join(sorted(self.known))} or an "
            "engramd that knows this one"
        )

    def expect(self, ok: bool, what: str) -> None:
        """Raise UnknownEngine naming `what` of the engine unless `ok`."""
        if not ok:
            raise self.unknown(what)


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
    """Call `then(module)` once `name` is imported: now, if it is already.

    Engines import a model family's modules only for that family's models:
    an adapter patches them then, not before.
    """
    if name in sys.modules:
        then(sys.modules[name])
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


#: Marks a function an adapter put in the engine's place.
MARK = "__engramd__"


class CallThrough:
    """The engine functions an adapter replaced, each kept under its replacement to call."""

    def __init__(self) -> None:
        self._original: dict[Callable[..., Any], Callable[..., Any]] = {}

    def replace(self, owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[..., Any]:
        """Put `replacement` where `owner.name` was; returns the engine's function."""
        original: Callable[..., Any] = getattr(owner, name)
        self._original[replacement] = original
        setattr(replacement, MARK, True)
        setattr(owner, name, replacement)
        return original

    def call(self, replacement: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the engine's function that `replacement` stands in for."""
        return self._original[replacement](*args, **kwargs)


def replaced(function: object) -> bool:
    """Whether `function` is one an adapter put in the engine's place."""
    return bool(getattr(function, MARK, False))


def params(function: Callable[..., object]) -> list[str]:
    """The names of `function`'s parameters, as an adapter checks a seam's signature."""
    return list(inspect.signature(function).parameters)


class Pattern(Protocol):
    """An engine's compiled pattern of Engram table names (`re` or the `regex` package)."""

    def search(self, string: str, /) -> object:
        """A match anywhere in `string`, or None."""


def say_once(log: logging.Logger, level: int, key: str, message: str, *args: object) -> None:
    """Log `message` once per process and `key` (engines load plugins several times)."""
    if key in _said:
        return
    _said.add(key)
    log.log(level, message, *args)


def share_mode() -> bool | None:
    """ENGRAMD_SHARE: None auto, True on (strict), False off."""
    return ClientConfig.from_env().share


def checkpoint_names(folder: str | os.PathLike[str]) -> list[str]:
    """Every tensor name of a safetensors checkpoint (headers only)."""
    files, _ = checkpoint_files(Path(folder))
    return [name for path in files for name in read_header(path).tensors]


def check_selection(
    folder: str | os.PathLike[str], engine_tables: Pattern, selection: str
) -> list[str]:
    """The tensors engramd would serve, when they are exactly the engine's n-gram tables.

    Compares checkpoint names (a joined table's shards, not the table).
    Raises SelectionRefused naming the tensors only one side names: serving
    fewer would leave the engine to read the rest, serving more would map
    tensors the engine loads as ordinary weights.
    """
    names = checkpoint_names(folder)
    ours = {n for n in names if fnmatch.fnmatchcase(n, selection)}
    theirs = {n for n in names if engine_tables.search(n)}
    if not theirs:
        raise SelectionRefused(f"{folder} holds no tensor the engine loads as an n-gram table")
    if ours != theirs:
        raise SelectionRefused(
            f"engramd's selection {selection!r} and the engine's n-gram tables differ in "
            f"{folder}: only engramd's: {sorted(ours - theirs)[:4]}, only the engine's: "
            f"{sorted(theirs - ours)[:4]}; engramd serves a checkpoint whose tables are named "
            "as DeepSeek-V4.1's (layers.L.engram.embed.weight / .scale) or Qwen4Exp's "
            "(...ple.ple_embedding.ngram_embedding.shard_N.weight)"
        )
    return sorted(ours)


@dataclass(frozen=True)
class Refusal:
    """Why engramd cannot serve, as it travels between ranks (picklable, plain)."""

    #: The engramd_shared.errors class that said it.
    kind: str
    message: str

    @classmethod
    def of(cls, error: EngramdError) -> Refusal:
        """The refusal an engramd error carries."""
        return cls(type(error).__name__, str(error))

    def throw(self) -> NoReturn:
        """Raise it again as the class that said it."""
        kind = getattr(errors, self.kind, ShareError)
        if not (isinstance(kind, type) and issubclass(kind, EngramdError)):
            kind = ShareError
        raise kind(self.message)


def probe(folder: str | os.PathLike[str], engine_tables: Pattern, selection: str) -> None:
    """Ask the daemon for the checkpoint's tables once (they load if they must), then let go.

    Raises the EngramdError that says why engramd cannot serve them here.
    """
    from engramd_client.share import attach

    stored = is_store_url(os.fspath(folder))
    if not stored:
        check_selection(folder, engine_tables, selection)
    # No device: an answer needs no CUDA views (ENGRAMD_DEVICE would register every row).
    tables = attach(folder, tensors=selection, share=True, device="")
    try:
        if stored:
            check_served(folder, tables.checkpoint_names, engine_tables)
    finally:
        tables.close()


def check_described(tables: Tables, described: Sequence[TableInfo], folder: str) -> None:
    """CheckpointError unless `tables` are of the set `described` describes: a URL names the
    set the operator loaded last, which may change between a worker's two calls."""
    if described and tables.set_id != described[0].set_id:
        tables.close()
        raise CheckpointError(
            f"engramd's set for {folder} changed from {described[0].set_id} to "
            f"{tables.set_id} while this worker attached it (a new version loaded): start "
            "the engine again"
        )


def check_served(
    url: str | os.PathLike[str], served: Iterable[str], engine_tables: Pattern
) -> None:
    """The set engramd loaded from an object store serves only the engine's n-gram tables.

    Its checkpoint's other names are not on the node to compare with (check_selection):
    what engramd does not serve of the engine's tables, the engine loads itself.
    """
    others = sorted(n for n in served if not engine_tables.search(n))
    if others:
        raise SelectionRefused(
            f"the set engramd loaded from {os.fspath(url)} holds tensors the engine loads as "
            f"ordinary weights ({others[:4]}); load it with the family's selection (auto)"
        )


def decide(
    ask: Callable[[], None],
    *,
    leader: bool = True,
    broadcast: Callable[[Refusal | None], Refusal | None] | None = None,
) -> Refusal | None:
    """None when engramd serves, else why not: the same answer on every rank of a group.

    The leader runs `ask` (which raises an EngramdError when engramd cannot
    serve); `broadcast` (the engine's collective, leader to all) gives every
    rank the leader's answer, so no two ranks of a group can decide apart.
    """
    refusal = None
    if leader:
        try:
            ask()
        except EngramdError as e:
            refusal = Refusal.of(e)
        except Exception as e:
            # The leader must reach the broadcast whatever happened, or the others wait.
            refusal = Refusal("ShareError", f"{type(e).__name__}: {e}")
    return broadcast(refusal) if broadcast is not None else refusal


def settle(
    refusal: Refusal | None,
    strict: bool | None,
    tables: str,
    engine_path: str,
    log: logging.Logger,
    live: bool = False,
) -> bool:
    """Whether to serve: strict raises the refusal; auto warns once that `engine_path` runs.

    `live`: the checkpoint's files are here, so where the daemon is only unreachable
    engramd serves its own private copy (each rank's attach warns once), which moves to
    the daemon's copy at a step once it is back (live tables, StepGate).
    """
    if refusal is None:
        return True
    if strict:
        refusal.throw()
    if live and refusal.kind == "DaemonUnavailable":
        return True
    say_once(
        log,
        logging.WARNING,
        "refusal",
        "engramd does not serve the %s here: %s. %s",
        tables,
        refusal.message,
        engine_path,
    )
    return False


def serving(log: logging.Logger, engine: str, what: str, tables: Tables) -> None:
    """The one line that says engramd serves an engine's tables in this process."""
    log.info(
        "engramd serves %s's %s (%s, %d tensors, %.2f GiB of rows)",
        engine,
        what,
        tables.mode,
        len(tables),
        tables.nbytes / 2**30,
    )


#: Steps between two votes of an engine's ranks on a pending move (StepGate): a move waits
#: at most this many steps after every rank has it in hand; between votes a step costs a
#: counter increment.
VOTE_EVERY = 16


class StepGate:
    """Where an engine starts a step: its live tables move there, every rank at the same step.

    A rank alone (or a worker without a group) moves at its next step. The
    ranks of a group vote every VOTE_EVERY steps, one MIN all-reduce of two
    integers on the engine's own CPU group (every rank counts the same steps:
    the engine runs each step on all of them): each rank names the set it
    would be on after a move (Tables.heading: its pending move's, else its
    own), and once every rank names the same one, those holding a move make
    it at that step, so no step reads a mix of copies or generations across
    ranks. `group()` gives the engine's GroupCoordinator (or None), asked at
    the first step, after the engine set its groups up.
    """

    def __init__(self, tables: Tables, group: Callable[[], Any]) -> None:
        self._tables = tables
        self._group = group
        self._agree: Callable[[str], bool] | None = None
        self._steps = 0

    def step(self) -> bool:
        """Called where a step starts; True when the tables moved at this step."""
        self._steps += 1
        if self._steps == 1:
            self._agree = agreement(self._group())
        if self._agree is None:
            return self._tables.advance()
        if self._steps % VOTE_EVERY:
            return False
        # The set voted on is the one moved to: a move that arrives on one rank between the
        # vote and the advance waits for the next vote, or that rank alone would move.
        heading = self._tables.heading
        return self._agree(heading) and self._tables.advance(to=heading)


def agreement(group: Any) -> Callable[[str], bool] | None:
    """Whether every rank of an engine's GroupCoordinator names the same set id (None: a
    rank alone)."""
    if group is None or group.world_size == 1:
        return None
    import torch.distributed as dist

    def agree(set_id: str) -> bool:
        # A 62-bit digest of the id and its negation: one MIN gives the least and the most.
        key = int.from_bytes(hashlib.blake2b(set_id.encode(), digest_size=8).digest()) >> 2
        vote = torch.tensor([key, -key], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group.cpu_group)
        return int(vote[0]) == -int(vote[1])

    return agree


def moved(log: logging.Logger, engine: str, tables: Tables) -> None:
    """The one line that says an engine's tables moved at this step."""
    log.info(
        "engramd's tables of %s moved to the %s copy at this step (set %s, same addresses)",
        engine,
        "daemon's" if tables.mode == "shared" else tables.mode,
        tables.set_id,
    )


def table_names(layer_id: int) -> tuple[str, str]:
    """Checkpoint names of layer `layer_id`'s Engram weight and scale."""
    return f"layers.{layer_id}.engram.embed.weight", f"layers.{layer_id}.engram.embed.scale"


def local_folder(name: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The checkpoint folder of an engine's model argument: a folder, a Hub id already cached,
    or an object store's s3://bucket/prefix (as is: its set is the daemon's to load).

    Raises ShareError with the fix when the model is neither (engramd serves
    files on this node; it never downloads).
    """
    if os.path.isdir(name) or is_store_url(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return str(
            snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except Exception as e:
        raise ShareError(
            f"the model {name} is neither a folder nor in the Hugging Face cache yet ({e}); "
            "download it first (hf download) or serve its folder"
        ) from None


def attach_rows(
    folder: str | os.PathLike[str],
    rows: RowRanges | None,
    *,
    strict: bool | None,
    device: str | None,
    labels: Mapping[str, str],
    selection: str,
    pad_rows: bool = False,
) -> Tables:
    """The selection's tables, each mapped only over its `rows` (None: whole), with CUDA
    views on `device`; with `pad_rows`, rows past a table's end are zeros.

    `strict` None: engramd's own private fallback (exact rows, one warning)
    where this one process cannot attach after its group chose engramd.
    """
    from engramd_client.share import attach

    return attach(
        folder,
        tensors=selection,
        rows=rows,
        share=strict,
        device=device or "",
        labels=labels,
        pad_rows=pad_rows,
    )


class ServedTableUpdate(EngramdError):
    """An engine's weight update would write a table engramd serves: refused, nothing written."""


def refuse_update(
    engine: str, call: str, names: Iterable[str] | None, served: frozenset[str]
) -> str | None:
    """Why an engine's weight update `call` of `names` (None: it may write any weight) is
    refused where this process serves `served` (checkpoint names); None where it writes
    none of them.

    The served tables' pages are the daemon's read-only copy, which every engine on
    the node maps: an engine's own update could only fault on them, or, skipping them,
    leave the tables as they were while reporting success.
    """
    if not served:
        return None
    hit = sorted(served) if names is None else sorted(served.intersection(names))
    if not hit:
        return None
    what = f"{', '.join(hit[:3])}{f' and {len(hit) - 3} more' if len(hit) > 3 else ''}"
    how = "may write every weight in place, " if names is None else "would write "
    return (
        f"{engine}'s {call} {how}{what} among them, which engramd serves from the daemon's "
        "read-only copy that every engine on this node maps: nothing was written. Load the "
        "tables' new revision with `engramd load <checkpoint folder>` (the same tensors and "
        "shapes; `--replaces <set id>` for another folder than the set's): every running "
        "engine moves to it at a step boundary. Update the other weights without these tables"
    )
