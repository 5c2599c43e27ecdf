"""One vLLM rank on CPU: loads the plugins, builds Qwen4Exp's PLE n-gram embeddings, loads them.

    python vllm_ple_rank.py RANK WORLD INIT_FILE CONFIG_PICKLE [--private-pin] [--no-load]
        [--multithread]
        [--dp N]
        [--lookup OUT.pt [--all-rows] [--evict DIR]... [--cgroup DIR] [--pause]]

With `--dp N`, WORLD ranks are N data-parallel replicas of WORLD / N TP
ranks whose PLE tables are split over all of them (`embedding_across_dp`).

With `--lookup`, each PLE layer then looks rows up through vLLM's own entry
points (`sync_lookup`, and `start_prefetch` / `finalize_prefetch`) for ids at
every shard and rank boundary and random ids (`--all-rows`: every row of the
first layer, in steps), and saves ids and results to OUT.pt. `--evict DIR`
drops the files under DIR from the page cache before the lookups and says
how many of their bytes the page cache holds after (fincore); `--cgroup DIR`
runs the lookups in memory cgroup DIR (v1), limited to what the rank uses
then plus a quarter of its tables; `--pause` prints PAUSED after the first
step and waits for a line on stdin before the second.

Everything is vLLM's own code (its plugin loader, distributed groups,
Qwen4ExpNGramEmbedding with its pinned-host tables and embedding methods,
AutoWeightsLoader, DefaultModelLoader, or RunaiModelStreamerLoader for an
s3:// model) except the few calls that need a GPU,
replaced in `cpu_only` with the reason beside each. Prints one JSON line
with what the rank holds and what its weight loading read.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine_harness import (
    anonymous_kib,
    disk_read_bytes,
    drop_cache,
    mapping_of,
    move_when_told,
)

from engramd.testing.pagecache import evict


def cpu_streams() -> None:
    """The CUDA stream calls of vLLM's prefetch entry points, as no-ops: one CPU "stream"."""

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.device = device

        def wait_stream(self, other: Any) -> None:
            pass

    torch.cuda.Stream = Stream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: Stream()  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment,return-value]
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign,assignment]


def cpu_only(private_pin: bool) -> None:
    """Replace the calls that need a GPU, before vLLM's PLE module binds them."""
    import vllm.utils.platform_utils as platform_utils
    import vllm.utils.torch_utils as torch_utils

    # The pinned-host table refuses to exist without UVA, which needs a GPU.
    platform_utils.is_uva_available = lambda: True
    # A UVA view of host memory needs a GPU: on CPU the table is its own view.
    torch_utils.get_accelerator_view_from_cpu_tensor = lambda tensor: tensor
    if private_pin:
        # vLLM's own private tables are pinned, which needs an accelerator:
        # exact-size pageable memory here.
        empty = torch.empty

        def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return empty(*args, **kwargs)

        torch.empty = unpinned  # type: ignore[assignment]


class Net(nn.Module):
    """The checkpoint's PLE layers under Qwen4Exp's names, each vLLM's own n-gram embedding."""

    def __init__(self, text_config: Any, dp_rank: int) -> None:
        super().__init__()
        from vllm.model_executor.models.utils import PPMissingLayer
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

        ids = sorted(text_config.ple_layer_ids)
        self.model = nn.Module()
        # The checkpoint's one tensor beside the PLE tables (engramd.testing.synth).
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.empty(1024, 64, dtype=torch.bfloat16))
        layers: list[nn.Module] = []
        for index in range(text_config.num_hidden_layers):
            if index + 1 not in ids:
                layers.append(PPMissingLayer())
                continue
            block = nn.Module()
            block.ple = nn.Module()
            block.ple.ple_embedding = Qwen4ExpNGramEmbedding(
                text_config,
                int(text_config.ple_embed_dim),
                ids.index(index + 1),
                16,
                data_parallel_rank=dp_rank,
                prefix=f"model.layers.{index}.ple.ple_embedding",
                params_dtype=torch.bfloat16,
            )
            layers.append(block)
        self.model.layers = nn.ModuleList(layers)

    def load_weights(self, weights: Any) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("config")
    parser.add_argument("--private-pin", action="store_true")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument(
        "--multithread", action="store_true", help="load with enable_multithread_load"
    )
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--lookup", default="")
    parser.add_argument("--all-rows", action="store_true")
    parser.add_argument("--evict", action="append", default=[])
    parser.add_argument("--cgroup", default="")
    parser.add_argument("--pause", action="store_true")
    parser.add_argument(
        "--live", default="", help="after loading, step until the tables move (move_when_told)"
    )
    args = parser.parse_args()

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())
    cpu_only(args.private_pin)
    if args.lookup:
        cpu_streams()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    with open(args.config, "rb") as f:
        config = pickle.load(f)
    # As `vllm serve -tp WORLD/DP -dp DP` configures it; the ETP group is the TP
    # group, or every rank with embedding_across_dp.
    tp = args.world // args.dp
    config.parallel_config.tensor_parallel_size = tp
    if args.dp > 1:
        config.parallel_config.data_parallel_size = args.dp
        config.engram_config.embedding_across_dp = True
    init_distributed_environment(
        world_size=args.world,
        rank=args.rank,
        distributed_init_method=f"file://{args.init_file}",
        local_rank=args.rank,
        backend="gloo",
    )
    out: dict[str, Any] = {"rank": args.rank}
    with set_current_vllm_config(config):
        initialize_model_parallel(tensor_model_parallel_size=tp)
        import vllm.models.qwen4_exp.common.ngram_embedding as ple

        table_class = ple.Qwen4ExpPLEPinnedHostEmbedding
        out["patched"] = bool(getattr(table_class.allocate_embedding_weight, "__engramd__", False))
        anonymous_before = anonymous_total_kib()
        started = time.monotonic()
        net = Net(config.model_config.hf_text_config, args.rank // tp)
        out["build_s"] = time.monotonic() - started
        layers = {}
        for name, module in net.named_modules():
            if isinstance(module, table_class):
                table: Any = module
                # The row tables (NVFP4's block scales too); fp8's global scale is no table.
                params = {
                    p: getattr(table, p)
                    for p in ("weight", "weight_scale")
                    if isinstance(getattr(table, p, None), torch.Tensor)
                    and getattr(table, p).dim() == 2
                }
                layers[name] = {
                    "start": table.shard_indices.org_vocab_start_index,
                    "end": table.shard_indices.org_vocab_end_index,
                    "rows": table.num_embeddings_per_partition,
                    "etp": [table.tp_rank, table.tp_size],
                    "dtypes": {p: str(t.dtype) for p, t in params.items()},
                    "shapes": {p: list(t.shape) for p, t in params.items()},
                    "nbytes": {p: t.numel() * t.element_size() for p, t in params.items()},
                    "storage_bytes": {p: t.untyped_storage().nbytes() for p, t in params.items()},
                    "maps": {p: mapping_of(t.data_ptr()) for p, t in params.items()},
                    "served": list(getattr(table, "_engramd_served", ())),
                    "uva_is_table": table._uva_weight.data_ptr() == table.weight.data_ptr(),
                }
        out["layers"] = layers
        if not args.no_load and config.load_config.load_format == "runai_streamer":
            from vllm.model_executor.model_loader.runai_streamer_loader import (
                RunaiModelStreamerLoader,
            )

            # The weights stream from the object store (model_config.model_weights).
            started = time.monotonic()
            RunaiModelStreamerLoader(config.load_config).load_weights(net, config.model_config)
            out["load_s"] = time.monotonic() - started
        elif not args.no_load:
            from vllm.config import LoadConfig

            folder = Path(config.model_config.model)
            loader = DefaultModelLoader(
                LoadConfig(
                    model_loader_extra_config={
                        "enable_weights_track": True,
                        "enable_multithread_load": args.multithread,
                    }
                )
            )
            group = torch.distributed.group.WORLD
            # One rank at a time: each measures its own reads with a cold cache.
            for turn in range(args.world):
                torch.distributed.barrier(group)
                if turn != args.rank:
                    continue
                drop_cache(folder)
                before, started = disk_read_bytes(folder), time.monotonic()
                loader.load_weights(net, config.model_config)
                out["read_bytes"] = disk_read_bytes(folder) - before
                out["load_s"] = time.monotonic() - started
            torch.distributed.barrier(group)
        if args.live:
            from vllm_rank import idle_step  # type: ignore[import-not-found]

            from engramd_client.engines.vllm.process import PROCESS

            def addresses() -> dict[str, int]:
                return {
                    f"{name}.{p}": net.get_submodule(name).get_parameter(p).data_ptr()
                    for name, info in layers.items()
                    for p in info["dtypes"]
                }

            addressed = addresses()
            out["live"] = move_when_told(args.rank, Path(args.live), idle_step(), PROCESS.tables)
            out["live"]["same_addresses"] = addresses() == addressed
            for name, info in layers.items():
                table = net.get_submodule(name)
                info["maps"] = {
                    p: mapping_of(table.get_parameter(p).data_ptr()) for p in info["dtypes"]
                }
                info["uva_is_table"] = table._uva_weight.data_ptr() == table.weight.data_ptr()
        for name, info in layers.items():
            table = net.get_submodule(name)
            if not args.lookup:
                # (Lookups check the rows themselves, reading only the ones they ask for.)
                info["sha256"] = {
                    p: hashlib.sha256(
                        table.get_parameter(p).data.view(torch.uint8).contiguous().numpy().tobytes()
                    ).hexdigest()
                    for p in info["dtypes"]
                }
            info["anonymous_kib"] = anonymous_kib(table.weight.data_ptr())
            if "weight_scale" not in info["dtypes"] and hasattr(table, "weight_scale"):
                # fp8's global scale: an ordinary parameter, loaded by vLLM.
                info["global_scale"] = float(table.weight_scale.float().reshape(-1)[0])
        if args.lookup:
            out.update(lookups(net, table_class, config, args))
            out["anonymous_growth_kib"] = anonymous_total_kib() - anonymous_before
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


def anonymous_total_kib() -> int:
    """The process's anonymous memory (its private pages: heap, copies), in KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    raise AssertionError("no Anonymous line in smaps_rollup")


def boundary_ids(table: Any, rows: int, parts: int, world: int, g: torch.Generator) -> torch.Tensor:
    """Ids on each side of every shard boundary and ETP rank boundary, and random ids,
    as [tokens, heads]."""
    shard = -(-rows // parts)
    edges = [k * shard for k in range(1, parts)] + [k * rows // world for k in range(1, world)]
    ids = [0, rows - 1] + [e + d for e in edges for d in (-1, 0)]
    ids += torch.randint(0, rows, (190,), generator=g).tolist()
    heads = table._num_ngram_heads
    ids += [0] * (-len(ids) % heads)
    return torch.tensor(ids, dtype=torch.long).view(-1, heads)


def lookups(net: Any, table_class: type, config: Any, args: Any) -> dict[str, Any]:
    """Rows looked up through vLLM's entry points; saved to args.lookup with their ids."""
    text = config.model_config.hf_text_config
    tp = args.world // args.dp
    dp_rank = args.rank // tp
    # The same tokens on every TP rank of a replica; each replica its own.
    g = torch.Generator().manual_seed(1000 + dp_rank)
    tables: list[tuple[str, Any]] = [
        (n, m) for n, m in net.named_modules() if isinstance(m, table_class)
    ]
    steps: dict[str, list[torch.Tensor]] = {}
    for name, table in tables:
        rows = table.org_vocab_size
        if args.all_rows and name == tables[0][0]:
            every = torch.arange(rows, dtype=torch.long)
            every = torch.cat([every, every.new_zeros(-rows % table._num_ngram_heads)])
            steps[name] = list(every.view(-1, table._num_ngram_heads).split(4096))
        elif not args.all_rows:
            steps[name] = [boundary_ids(table, rows, int(text.split_ngram_parts), args.world, g)]
    for folder in args.evict:
        evict(Path(folder))
    report: dict[str, Any] = {"cached_before": {f: fincore(Path(f)) for f in args.evict}}
    if args.cgroup:
        report["cgroup"] = join_cgroup(Path(args.cgroup), tables[0][1])
    saved: dict[str, Any] = {}
    for step in range(2 if args.pause else 1):
        if step == 1:
            print("PAUSED", flush=True)
            sys.stdin.readline()
        for name, table in tables:
            digests = {"local": hashlib.sha256(), "sync": hashlib.sha256()}
            for ids in steps.get(name, []):
                local = table._lookup(ids)
                with step_context(config, ids.shape[0], args.dp):
                    got = table.sync_lookup(ids)
                if args.all_rows:
                    # Every row: digests only, the rank's memory stays the step's.
                    digests["local"].update(local.view(torch.uint8).numpy().tobytes())
                    digests["sync"].update(got.view(torch.uint8).numpy().tobytes())
                    continue
                prefetched = []
                # As many tokens a step as vLLM's prefetch buffer holds.
                for chunk in ids.split(table._prefetch_rows // table.etp_data_parallel_size):
                    with step_context(config, chunk.shape[0], args.dp):
                        table.start_prefetch(chunk)
                        prefetched.append(table.finalize_prefetch(chunk.shape[0]).clone())
                indices = table.shard_indices
                saved.setdefault(f"{name}/{step}", []).append(
                    {
                        "ids": ids,
                        # This rank's own rows before the ETP reduce (vLLM's `_lookup`).
                        "local": local.clone(),
                        "range": (indices.org_vocab_start_index, indices.org_vocab_end_index),
                        "sync": got.clone(),
                        "prefetch": torch.cat(prefetched),
                    }
                )
            if args.all_rows and name in steps:
                saved[f"{name}/{step}/sha256"] = {k: d.hexdigest() for k, d in digests.items()}
            scale2 = getattr(table, "weight_scale_2", None)
            if scale2 is not None:
                saved[f"{name}/weight_scale_2"] = scale2.detach().clone()
    if args.cgroup:
        report["cgroup"].update(leave_cgroup(Path(args.cgroup)))
    torch.save(saved, args.lookup.format(rank=args.rank))
    report["cached"] = {folder: fincore(Path(folder)) for folder in args.evict}
    return report


def step_context(config: Any, tokens: int, dp: int) -> Any:
    """vLLM's forward context of a step of `tokens` tokens on each of `dp` replicas."""
    from vllm.forward_context import set_forward_context

    across = torch.tensor([tokens] * dp) if dp > 1 else None
    return set_forward_context(None, config, num_tokens=tokens, num_tokens_across_dp=across)


def fincore(folder: Path) -> int:
    """Bytes of the files under `folder` in the page cache, as util-linux's fincore counts."""
    files = [str(p) for p in sorted(folder.rglob("*")) if p.is_file()]
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(line) for line in done.stdout.split())


def join_cgroup(group: Path, table: Any) -> dict[str, int]:
    """Move this process into memory cgroup `group`: what it is charged from now on (its
    charges so far stay where they were) limited to a quarter of `table`'s rows (the layer
    every row of which it reads), beside ANON_ROOM for its own memory."""
    table_bytes = table.weight.numel() * table.weight.element_size()
    (group / "cgroup.procs").write_text(str(os.getpid()))
    used = int((group / "memory.usage_in_bytes").read_text())
    limit = used + ANON_ROOM + table_bytes // 4
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return {"table_bytes": table_bytes, "limit": limit}


#: Room in the cgroup for the rank's own memory while it looks rows up (the step's ids and
#: rows, its threads' stacks): the rest of the limit is the page cache's.
ANON_ROOM = 8 << 20


def leave_cgroup(group: Path) -> dict[str, int]:
    """Back to the root memory cgroup (the group can then be removed); what the group saw:
    its peak, how often the limit was hit, the page cache it held at the end."""
    stat = dict(
        (line.split()[0], int(line.split()[1]))
        for line in (group / "memory.stat").read_text().splitlines()
    )
    seen = {
        "max_usage": int((group / "memory.max_usage_in_bytes").read_text()),
        "failcnt": int((group / "memory.failcnt").read_text()),
        "cache": stat["cache"],
    }
    (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    return seen


if __name__ == "__main__":
    main()
