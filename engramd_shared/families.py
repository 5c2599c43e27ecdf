"""The families of n-gram tables engramd serves, and which one a checkpoint holds.

- `ENGRAM`: DeepSeek-V4.1's Engram tables, `layers.L.engram.embed.weight`
  and `.scale` per Engram layer (heads stacked, split by head per TP rank).
- `PLE`: Qwen4Exp's PLE n-gram table,
  `...ple.ple_embedding.ngram_embedding.shard_N.weight` (and NVFP4's block
  scales `shard_N.weight_scale`): row shards of one vocabulary, joined into
  one table per layer (checkpoint.py), split by vocab range per rank. The
  table's global scales (`ngram_embedding.weight_scale` of fp8,
  `weight_scale_2` of NVFP4) are ordinary small parameters: not selected.

`AUTO` as a selection picks the family of the checkpoint: by its
config.json architectures where it names one, else by which family's
tensors it holds.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engramd_shared.errors import CheckpointError

#: The selection that picks the family of each checkpoint.
AUTO = "auto"


@dataclass(frozen=True)
class Family:
    """One kind of n-gram table: its selection and the architectures that carry it."""

    #: As status shows it.
    name: str
    #: What the tables are called in messages.
    tables: str
    #: fnmatch selection of the family's tensors in a checkpoint.
    selection: str
    #: config.json `architectures` that carry this family.
    architectures: frozenset[str]

    def selects(self, names: Iterable[str]) -> bool:
        """Whether any of `names` is one of this family's tensors."""
        return any(fnmatch.fnmatchcase(n, self.selection) for n in names)


ENGRAM = Family(
    "engram",
    "Engram tables",
    "*engram.embed.*",
    frozenset({"DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM"}),
)
PLE = Family(
    "ple",
    "PLE n-gram tables",
    "*.ple_embedding.ngram_embedding.shard_*",
    frozenset({"Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"}),
)
FAMILIES = (ENGRAM, PLE)

CONFIG_FILE = "config.json"
#: A model's config.json is a few KiB; anything far larger is not one.
MAX_CONFIG_BYTES = 4 << 20


def family_of_selection(selection: str) -> Family | None:
    """The family whose selection this is, or None for an operator's own."""
    return next((f for f in FAMILIES if f.selection == selection), None)


def architectures(folder: Path) -> list[str]:
    """config.json's `architectures` of a checkpoint folder; [] where it names none."""
    try:
        with open(folder / CONFIG_FILE, "rb") as f:
            return architectures_in(f.read(MAX_CONFIG_BYTES))
    except OSError:
        return []


def architectures_of(fd: int) -> list[str]:
    """config.json's `architectures`, read from a descriptor of it; [] where it names none."""
    try:
        with open(os.dup(fd), "rb") as f:
            f.seek(0)
            return architectures_in(f.read(MAX_CONFIG_BYTES))
    except OSError:
        return []


def architectures_in(text: bytes) -> list[str]:
    """The `architectures` a config.json's text names; [] where it names none."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return []
    found = doc.get("architectures") if isinstance(doc, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def family_of(
    folder: Path | str, names: Iterable[str], named: Iterable[str] | None = None
) -> Family:
    """The family of a checkpoint: its architecture's, else the one whose tensors it holds.

    `named`: the architectures of its config.json where the caller read it
    (beneath a root); None reads `folder`'s. Raises CheckpointError when the
    checkpoint holds neither family (or both, with no architecture to decide).
    """
    if named is None:
        named = architectures(Path(folder)) if Path(folder).is_dir() else []
    named = set(named)
    for family in FAMILIES:
        if named & family.architectures:
            return family
    names = list(names)
    holding = [f for f in FAMILIES if f.selects(names)]
    if len(holding) == 1:
        return holding[0]
    what = "both" if holding else "neither"
    raise CheckpointError(
        f"{folder}: holds {what} of engramd's table families "
        f"({', '.join(f'{f.tables} {f.selection!r}' for f in FAMILIES)}), and "
        + (
            f"its {CONFIG_FILE} names no architecture that decides"
            if named
            else f"no {CONFIG_FILE} there names an architecture (none, or no such file)"
        )
        + "; pass the selection (--tensors, tensors=...)"
    )
