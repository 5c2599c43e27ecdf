"""Qwen4Exp's PLE n-gram table in SGLang, from engramd.

With `--ple-offload-embedding` (SGLang's default for a bf16 Qwen4Exp on
CUDA) and the `pinned` backend, SGLang keeps each PLE layer's TP rank's
vocab range of the table in pinned host memory (with the `file` backend, in
a file it maps: ple_file.py), and its loader copies the
overlapping rows of the checkpoint's row shards into it. With the daemon on
the node, that range is a read-only view of the daemon's one copy of the
layer's table (the shards back to back, engramd_shared.checkpoint):
TP ranks and separate TP1 servers on a node map one copy, the GPU reads it
through engramd's CUDA views, and SGLang's loader reads none of the shards
(they reach it as empty placeholders, weights.py, and copy no row) yet
counts them loaded. bf16 and fp8 tables are served; fp8's `weight_scale`
stays SGLang's (a bf16 [1] device buffer loaded as any buffer).

The rank's rows are SGLang's: its VocabParallelEmbedding pads the
vocabulary to 64 (times the TP size where that does not divide), so the
last rank's range runs past the checkpoint's end; those rows are zeros of
the worker's own (`pad_rows`), as SGLang's kernel never reads them. The
group is TP, or attention-TP with `SGLANG_USE_ATTN_TP_NGRAM`, as SGLang's
own embedding decides.

The seams, in SGLang 0.5.23's `sglang.srt.models.qwen4_exp` (patched when
SGLang imports that module, see `install`; guard.check_ple_seams first):

- `Qwen4ExpNGramEmbedding.__init__` (around): the layer's `prefix` and
  config, for the allocation below, which is told neither.
- `allocate_ple_host_table`, as that module imports it (around): called by
  `Qwen4ExpPinnedHostEmbedding.__init__` with the table's shape and dtype,
  the backend and the tag `rows{org_vocab_start}-{org_vocab_end}`. The first
  call attaches every PLE table's rows for this rank at once, each range
  computed by SGLang's own VocabParallelEmbedding (built on the meta device
  as SGLang builds the layer's); each call checks its layer's shape, dtype
  and tag against it. The kernel reads `weight.data_ptr()` directly: with a
  CUDA device and the `pinned` backend the table SGLang gets is engramd's
  CUDA view of the rows; with the `file` backend the host mapping itself,
  which the GPU reads through the host page tables as it reads SGLang's own.
- `make_ple_file_prefetcher` and `make_ple_file_rss_trimmer`, as that module
  imports them (around: for the tables engramd serves, ple_file.py's
  prefetcher, and SGLang's PleFileRssTrimmer over the table's file pages).

One decision per TP group, as for the Engram tables: rank 0 asks the daemon
and SGLang's TP group broadcasts the answer. A checkpoint whose shards
SGLang would place otherwise than back to back (every shard but the last
`ceil(rows / split_ngram_parts)` rows), or whose dtype is not the one SGLang
allocates, is not served (strict: start-up fails).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import re
from dataclasses import dataclass
from importlib.metadata import version
from types import ModuleType
from typing import Any

import torch

from engramd_client.engines.common import (
    Refusal,
    UnknownEngine,
    attach_rows,
    check_described,
    replaced,
    say_once,
    settle,
    share_mode,
)
from engramd_client.engines.sglang import ple_file, weights
from engramd_client.engines.sglang.guard import check_ple_seams
from engramd_client.engines.sglang.process import PROCESS, engine_path, log
from engramd_client.mapping import torch_dtype
from engramd_client.share import TableInfo, describe
from engramd_client.tables import Tables
from engramd_shared.errors import CheckpointError, EngramdError
from engramd_shared.families import PLE

QWEN4_EXP = "sglang.srt.models.qwen4_exp"
PLE_TABLE = "sglang.srt.models.qwen4_exp_ple_table"
VOCAB = "sglang.srt.layers.vocab_parallel_embedding"
#: SGLang's own pattern of the PLE shards its Qwen4Exp loader takes (`load_qwen4_exp_ple_shard`).
PLE_TABLES = re.compile(r"\.ngram_embedding\.shard_(\d+)\.weight$")
#: What SGLang does where engramd does not serve, for the one warning.
OWN_TABLES = "PLE n-gram host tables (--ple-offload-embedding)"
#: The backends engramd serves (SGLang's --ple-offload-backend).
SERVED_BACKENDS = ("pinned", "file")
#: Set on the tables engramd serves to the file backend (its prefetcher finds them by it).
SERVED_MARK = "_engramd_ple_rows"
#: SGLang's default `split_ngram_parts` (its loader's, where the config names none).
SPLIT_NGRAM_PARTS = 512

#: The decoder layer of a PLE table, in SGLang's prefixes and the checkpoint's names alike
#: (`model.layers.K...` or `model.language_model.layers.K...`).
_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.ple\.ple_embedding(?:\.ngram_embedding\.weight)?$")


@dataclass(frozen=True)
class _Building:
    """The Qwen4ExpNGramEmbedding being built: its prefix and (text) config."""

    prefix: str
    config: Any


_building: contextvars.ContextVar[_Building | None] = contextvars.ContextVar(
    "engramd_sglang_ple_layer", default=None
)


def install(module: ModuleType) -> None:
    """Put the plugin's functions in `module`'s place (SGLang's qwen4_exp), all or none.

    Called when SGLang imports the module (common.when_imported): SGLang
    imports its model modules when it resolves the model's architecture.
    """
    if replaced(module.allocate_ple_host_table):
        return
    try:
        check_ple_seams(module, importlib.import_module(VOCAB))
        weights.install()
    except UnknownEngine as e:
        say_once(log, logging.WARNING, "unknown", "%s", e)
        return
    except Exception as e:
        # Inside SGLang's import of its model: a failure here must not cost it the model.
        say_once(
            log,
            logging.WARNING,
            "unknown",
            "engramd's SGLang plugin cannot patch %s (%s: %s): it is disabled and SGLang "
            "allocates its own %s",
            module.__name__,
            type(e).__name__,
            e,
            OWN_TABLES,
        )
        return
    calls = PROCESS.calls
    calls.replace(module.Qwen4ExpNGramEmbedding, "__init__", _embedding_init)
    calls.replace(module, "allocate_ple_host_table", _allocate)
    calls.replace(module, "make_ple_file_prefetcher", _prefetcher)
    calls.replace(module, "make_ple_file_rss_trimmer", _trimmer)
    log.debug("engramd's SGLang plugin serves Qwen4Exp PLE n-gram tables")


def _embedding_init(self: Any, *args: Any, **kwargs: Any) -> None:
    # (self, config, embedding_dim, ple_layer_index, quant_config, prefix), as the guard checked.
    config = args[0] if args else kwargs["config"]
    prefix = args[4] if len(args) > 4 else kwargs.get("prefix", "")
    token = _building.set(_Building(str(prefix), config))
    try:
        PROCESS.calls.call(_embedding_init, self, *args, **kwargs)
    finally:
        _building.reset(token)


def _allocate(
    shape: Any,
    dtype: torch.dtype,
    backend: str = "pinned",
    table_dir: str | None = None,
    tag: str | None = None,
) -> torch.Tensor:
    def own() -> torch.Tensor:
        result: torch.Tensor = PROCESS.calls.call(_allocate, shape, dtype, backend, table_dir, tag)
        return result

    building = _building.get()
    if building is None:
        return own()
    if backend not in SERVED_BACKENDS:
        say_once(
            log,
            logging.INFO,
            "ple-backend",
            "--ple-offload-backend %s: engramd's SGLang plugin stands aside for the PLE n-gram "
            "tables (it serves the %s backends)",
            backend,
            "/".join(SERVED_BACKENDS),
        )
        return own()
    if not _decide(building, dtype, backend):
        return own()
    tables = PROCESS.tables or _attach(dtype, backend)
    name = _table_of(building.prefix, tables)
    _check(name, tables, tuple(int(d) for d in shape), dtype, tag)
    if backend == "file":
        # Read by the GPU through the host page tables, as SGLang's own file: no CUDA view.
        table = tables[name]
        if tables.mode == "shared":
            ple_file.advise_random(table, f"engramd set {tables.set_id}: {name}")
            setattr(table, SERVED_MARK, True)
        # else engramd's private copy: memory of this process's own, with nothing to
        # prefetch, and no file pages a trimmer could drop without losing rows.
        return table
    return tables.cuda(name) if tables.device is not None else tables[name]


def _prefetcher(table: torch.Tensor) -> Any:
    """SGLang's prefetcher for its own file; for a table engramd serves, one that advises
    the daemon's pages by address (ple_file.MappedPrefetcher)."""
    if not getattr(table, SERVED_MARK, False):
        return PROCESS.calls.call(_prefetcher, table)
    from sglang.srt.environ import envs

    if not envs.SGLANG_QWEN4_PLE_FILE_PREFETCH.get():
        return None
    ple_table = importlib.import_module(PLE_TABLE)
    return ple_file.MappedPrefetcher(
        table, ple_table.PleFilePrefetcher.pages_for_rows, ple_table.PLE_FILE_PREFETCH_MIN_ROWS
    )


def _trimmer(table: torch.Tensor) -> Any:
    """SGLang's resident-set trimmer for its own file; for a table engramd serves, SGLang's
    PleFileRssTrimmer over the table's file pages only (ple_file.file_span), none where
    it has none."""
    if not getattr(table, SERVED_MARK, False):
        return PROCESS.calls.call(_trimmer, table)
    from sglang.srt.environ import envs

    budget = float(envs.SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB.get())
    if budget <= 0:
        return None
    span = ple_file.file_span(table)
    if span is None:
        return None
    address, nbytes = span
    trimmer = importlib.import_module(PLE_TABLE).PleFileRssTrimmer(
        addr=address,
        nbytes=nbytes,
        budget_bytes=int(budget * 2**30),
        interval_s=float(envs.SGLANG_QWEN4_PLE_FILE_RSS_INTERVAL_S.get()),
    )
    trimmer.start()
    return trimmer


def _decide(building: _Building, dtype: torch.dtype, backend: str) -> bool:
    """Whether engramd serves: the TP group's one answer, then whether SGLang's layout fits.

    The file backend's table is never live: where the daemon is down, SGLang's own runs.
    """
    if PROCESS.serve is not None:
        return PROCESS.serve
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # Every rank builds its first PLE layer at the same point; the leader's answer reaches
    # all of them. The TP group holds the attention-TP groups too.
    group = parallel.tp_group if parallel.tp_size > 1 else None
    if not PROCESS.decide(PLE, PLE_TABLES, OWN_TABLES, group, live=backend == "pinned"):
        return False
    # The same checkpoint and config on every rank: the same answer without a collective.
    reason = _misfit(PROCESS.folder, building.config, dtype)
    if reason is not None:
        PROCESS.serve = settle(
            Refusal("CheckpointError", reason),
            share_mode(),
            PLE.tables,
            engine_path(OWN_TABLES),
            log,
        )
    return bool(PROCESS.serve)


def _misfit(folder: str, config: Any, dtype: torch.dtype) -> str | None:
    """Why engramd's tables are not the bytes SGLang would load into its tables, or None."""
    split = int(getattr(config, "split_ngram_parts", SPLIT_NGRAM_PARTS))
    try:
        described = _described(folder)
    except EngramdError as e:
        # Each rank asks (for a URL, the daemon): one that cannot is refused, as a folder
        # it cannot read would be.
        return f"engramd cannot describe the PLE tables of {folder}: {e}"
    for table in described:
        if torch_dtype(table.dtype) != dtype:
            return (
                f"{table.name} of {folder} is {torch_dtype(table.dtype)} where SGLang allocates "
                f"{dtype} (it would convert the rows as it copies them); serve a checkpoint of "
                "the dtype SGLang keeps (text_config.ple_embedding_dtype)"
            )
        if table.parts and not table.part_rows:
            return (
                f"engramd does not say how the rows of {table.name} fall into its shards (a set "
                "loaded by an older engramd): load it again"
            )
        shard = -(-table.shape[0] // split)
        rows = list(table.part_rows) or [table.shape[0]]
        if any(n != shard for n in rows[:-1]) or not 0 < rows[-1] <= shard:
            return (
                f"the row shards of {table.name} in {folder} hold {rows} rows, and SGLang "
                f"places shard N at row N x {shard} (ceil({table.shape[0]} rows / "
                f"split_ngram_parts {split})): engramd's back-to-back table would not be "
                "SGLang's; the checkpoint does not match the model's config"
            )
    return None


@functools.cache
def _described(folder: str) -> tuple[TableInfo, ...]:
    """The checkpoint's PLE tables, read once: from its folder, or from the daemon for the
    s3:// URL of a set it loaded (no files here)."""
    return tuple(describe(folder, tensors=PLE.selection))


def _ranges(tables: tuple[TableInfo, ...], dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """Each PLE table's rows [start, stop) on this rank, as SGLang's own embedding splits them.

    Built as Qwen4ExpNGramEmbedding builds its VocabParallelEmbedding (on the
    meta device, its group TP or attention-TP): its padded range for this
    rank, which may run past the table's end.
    """
    qwen4_exp = importlib.import_module(QWEN4_EXP)
    vocab = importlib.import_module(VOCAB)
    ranges = {}
    for table in tables:
        with torch.device("meta"):
            split = vocab.VocabParallelEmbedding(
                table.shape[0],
                table.shape[1],
                params_dtype=dtype,
                use_attn_tp_group=qwen4_exp._use_attn_tp_ngram(),
            )
        start = int(split.shard_indices.padded_org_vocab_start_index)
        ranges[table.name] = (start, start + int(split.num_embeddings_per_partition))
    return ranges


def _attach(dtype: torch.dtype, backend: str) -> Tables:
    """Every PLE table's rows for this rank, attached once (registered with CUDA for the
    pinned backend only: the file backend's GPU reads pageable memory)."""
    from sglang.srt.runtime_context import get_parallel

    described = _described(PROCESS.folder)
    PROCESS.rows = _ranges(described, dtype)
    PROCESS.table_rows = {t.name: t.shape[0] for t in described}
    device = None
    if backend == "pinned" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    # SGLang builds its model under its device as the default: the host tables (and a
    # private copy) must be made in host memory whatever that default is.
    with torch.device("cpu"):
        tables = attach_rows(
            PROCESS.folder,
            PROCESS.rows,
            # After the group's decision only engramd's own private copy of exact rows may
            # stand in: the other ranks built their layers on engramd's answer.
            strict=True if share_mode() else None,
            device=device,
            labels={
                "engine": "sglang",
                "engine_version": version("sglang"),
                "tp_rank": str(get_parallel().tp_rank),
                "family": PLE.name,
            },
            selection=PLE.selection,
            pad_rows=True,
        )
    check_described(tables, described, PROCESS.folder)
    return PROCESS.hold(tables, PLE.tables)


def _table_of(prefix: str, tables: Tables) -> str:
    """The served table of the layer whose PLE embedding has this prefix."""
    layer = _LAYER.search(prefix)
    for name in tables:
        match = _LAYER.search(name)
        if layer is not None and match is not None and match[1] == layer[1]:
            return name
    raise CheckpointError(
        f"{PROCESS.folder} holds no PLE table for SGLang's layer {prefix} (engramd holds "
        f"{sorted(tables)[:4]}): the checkpoint does not match the model's config"
    )


def _check(
    name: str, tables: Tables, shape: tuple[int, ...], dtype: torch.dtype, tag: str | None
) -> None:
    """Raise CheckpointError unless the served rows are exactly the table SGLang allocates.

    SGLang's tag names the rank's rows of the checkpoint's vocabulary (its
    padded range clamped to the vocabulary's end), the shape its padded rows.
    """
    table = tables[name]
    start, stop = PROCESS.rows[name]
    end = PROCESS.table_rows[name]
    expected = f"rows{min(start, end)}-{min(stop, end)}"
    if tuple(table.shape) != shape or table.dtype != dtype or tag != expected:
        raise CheckpointError(
            f"{name} of {PROCESS.folder} gives rows {start}..{stop} ({expected}, "
            f"{tuple(table.shape)}, {table.dtype}) where SGLang's layer allocates {shape} "
            f"{dtype} for its {tag}: the checkpoint does not match the model's config"
        )
