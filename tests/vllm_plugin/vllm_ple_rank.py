"""One vLLM rank on CPU: loads the plugins, builds Qwen4Exp's PLE n-gram embeddings, loads them.

    python vllm_ple_rank.py RANK WORLD INIT_FILE CONFIG_PICKLE [--private-pin] [--no-load]
        [--multithread]
        [--dp N]

With `--dp N`, WORLD ranks are N data-parallel replicas of WORLD / N TP
ranks whose PLE tables are split over all of them (`embedding_across_dp`).

Everything is vLLM's own code (its plugin loader, distributed groups,
Qwen4ExpNGramEmbedding with its pinned-host tables and embedding methods,
AutoWeightsLoader, DefaultModelLoader, or RunaiModelStreamerLoader for an
s3:// model) except the few calls that need a GPU,
replaced in `cpu_only` with the reason beside each. Prints one JSON line
with what the rank holds and what its weight loading read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
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
    parser.add_argument(
        "--live", default="", help="after loading, step until the tables move (move_when_told)"
    )
    args = parser.parse_args()

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())
    cpu_only(args.private_pin)
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
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
