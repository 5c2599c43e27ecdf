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
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from engramd_client.core import errors
from engramd_client.core.checkpoint import DEFAULT_TENSORS, checkpoint_files, read_header
from engramd_client.core.config import ClientConfig
from engramd_client.core.errors import EngramdError, SelectionRefused, ShareError
from engramd_client.mapping import RowRanges
from engramd_client.tables import Tables

#: The selection the adapters attach with: the daemon's default (--tensors).
SELECTION = DEFAULT_TENSORS

_said: set[str] = set()


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
    folder: str | os.PathLike[str], engine_tables: Pattern, selection: str = SELECTION
) -> list[str]:
    """The tensors engramd would serve, when they are exactly the engine's Engram tables.

    Raises SelectionRefused naming the tensors only one side names: serving
    fewer would leave the engine to read the rest, serving more would map
    tensors the engine loads as ordinary weights.
    """
    names = checkpoint_names(folder)
    ours = {n for n in names if fnmatch.fnmatchcase(n, selection)}
    theirs = {n for n in names if engine_tables.search(n)}
    if not theirs:
        raise SelectionRefused(f"{folder} holds no tensor the engine loads as an Engram table")
    if ours != theirs:
        raise SelectionRefused(
            f"engramd's selection {selection!r} and the engine's Engram tables differ in "
            f"{folder}: only engramd's: {sorted(ours - theirs)[:4]}, only the engine's: "
            f"{sorted(theirs - ours)[:4]}; engramd serves a checkpoint whose Engram tables "
            "are named layers.L.engram.embed.weight / .scale"
        )
    return sorted(ours)


@dataclass(frozen=True)
class Refusal:
    """Why engramd cannot serve, as it travels between ranks (picklable, plain)."""

    #: The engramd_client.core.errors class that said it.
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


def probe(folder: str | os.PathLike[str], engine_tables: Pattern) -> None:
    """Ask the daemon for the checkpoint's tables once (they load if they must), then let go.

    Raises the EngramdError that says why engramd cannot serve them here.
    """
    from engramd_client.share import attach

    check_selection(folder, engine_tables)
    # No device: an answer needs no CUDA views (ENGRAMD_DEVICE would register every row).
    tables = attach(folder, tensors=SELECTION, share=True, device="")
    tables.close()


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
    refusal: Refusal | None, strict: bool | None, engine_path: str, log: logging.Logger
) -> bool:
    """Whether to serve: strict raises the refusal; auto warns once that `engine_path` runs."""
    if refusal is None:
        return True
    if strict:
        refusal.throw()
    say_once(
        log,
        logging.WARNING,
        "refusal",
        "engramd does not serve the Engram tables here: %s. %s",
        refusal.message,
        engine_path,
    )
    return False


def attach_rows(
    folder: str | os.PathLike[str],
    rows: RowRanges,
    *,
    strict: bool | None,
    device: str | None,
    labels: Mapping[str, str],
) -> Tables:
    """The selection's tables, each mapped only over its `rows`, with CUDA views on `device`.

    `strict` None: engramd's own private fallback (exact rows, one warning)
    where this one process cannot attach after its group chose engramd.
    """
    from engramd_client.share import attach

    return attach(
        folder, tensors=SELECTION, rows=rows, share=strict, device=device or "", labels=labels
    )
