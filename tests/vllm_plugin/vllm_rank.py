"""One vLLM rank on CPU: loads the plugins, builds real Engram layers, loads the checkpoint.

    python vllm_rank.py RANK WORLD INIT_FILE CONFIG_PICKLE [--private-pin] [--version V]
        [--no-load] [--load-format F] [--reference FOLDER] [--live FOLDER]

Everything is vLLM's own code (its plugin loader, distributed groups, Engram
layers, ColumnParallelLinear, DefaultModelLoader, DeepSeek-V4.1's weight
mapper) except the few calls that need a GPU, replaced in `cpu_only` with
the reason beside each. Prints one JSON line with what the rank holds and
what its weight loading read.
"""

from __future__ import annotations

import argparse
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
from engine_harness import anonymous_kib, drop_cache, io_read_bytes, mapping_of, move_when_told


def cpu_only(private_pin: bool) -> None:
    """Replace the calls that need a GPU; nothing else of vLLM's."""
    import vllm.models.deepseek_v41.common.engram as engram

    # ParallelEngramEmbedding refuses CPU offload without UVA, which needs a GPU.
    engram.is_uva_available = lambda: True

    # The layer sizes its lookup grid from the GPU's SM count (never used on CPU).
    def properties(device: Any = None) -> Any:
        return type("Props", (), {"multi_processor_count": 8})()

    torch.cuda.get_device_properties = properties
    # No accelerator: the layer asks for the current device's index.
    torch.accelerator.current_device_index = lambda: 0

    class Stream:
        # Engram's prefetch stream and event are CUDA objects.
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    torch.cuda.Stream = Stream  # type: ignore[misc, assignment]
    torch.cuda.Event = Stream  # type: ignore[misc, assignment]
    if private_pin:
        # vLLM's own private tables are pinned, which needs an accelerator:
        # exact-size pageable memory here (real pinned memory rounds up to a
        # power of two).
        empty = torch.empty

        def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return empty(*args, **kwargs)

        torch.empty = unpinned  # type: ignore[assignment]


class Block(nn.Module):
    """A decoder layer's place for the synthetic checkpoint's tensors beside the Engram."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.wq = nn.Module()
        self.attn.wq.weight = nn.Parameter(torch.empty(hidden, hidden, dtype=torch.bfloat16))
        self.ffn = nn.Module()
        self.ffn.norm = nn.Module()
        self.ffn.norm.weight = nn.Parameter(torch.empty(hidden, dtype=torch.float32))


class Net(nn.Module):
    """The checkpoint's modules under DeepSeek-V4.1's names, its Engram layers vLLM's own."""

    def __init__(self, hf_config: Any, embed_rows: int, hidden: int) -> None:
        super().__init__()
        from vllm.model_executor.models.utils import PPMissingLayer
        from vllm.models.deepseek_v41.common.engram import Engram, EngramLayout
        from vllm.models.deepseek_v41.nvidia.model import _make_deepseek_v4_weights_mapper

        self.hf_to_vllm_mapper = _make_deepseek_v4_weights_mapper("fp8")
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(
            torch.empty(embed_rows, hidden, dtype=torch.bfloat16)
        )
        layout = EngramLayout.from_config(hf_config)
        assert layout is not None
        self.model = nn.Module()
        layers: list[nn.Module] = []
        for layer_id in range(hf_config.num_hidden_layers):
            if layer_id not in layout.layer_ids:
                layers.append(PPMissingLayer())
                continue
            block = Block(hidden)
            block.engram = Engram(
                hf_config,
                None,
                layout,
                layout.layer_ids.index(layer_id),
                use_sequence_parallel=False,
                prefix=f"model.layers.{layer_id}.engram",
            )
            layers.append(block)
        self.model.layers = nn.ModuleList(layers)

    def load_weights(self, weights: Any) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


def lookups(net: nn.Module, table_class: type) -> dict[str, torch.Tensor]:
    """Each Engram table's lookup (vLLM's Triton kernel, on the GPU) of random valid hash ids."""
    found: dict[str, torch.Tensor] = {}
    for name, module in net.named_modules():
        if not isinstance(module, table_class):
            continue
        table: Any = module
        g = torch.Generator().manual_seed(len(found))
        start, end = table.vocab_start_idx, table.vocab_end_idx
        ids = torch.randint(start, end, (257, table.n_hash_cols), generator=g)
        shape = (257, table.part_n_hash_cols, table.dim)
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        table.lookup(ids.cuda(), out)
        found[name] = out.cpu()
    return found


def idle_step() -> Any:
    """A step as vLLM starts one on an idle rank: its Worker's execute_dummy_batch, which the
    plugin's hook runs first; the model runner's dummy forward (a GPU's) does nothing here."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    class Runner:
        # The forward pass needs a GPU.
        def _dummy_run(self, *args: Any, **kwargs: Any) -> None:
            pass

    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.model_runner = Runner()
    assert getattr(gpu_worker.Worker.execute_dummy_batch, "__engramd__", False)
    return lambda: worker.execute_dummy_batch()


def weight_updates(served: list[str]) -> dict[str, str]:
    """vLLM's Worker weight updates on a rank serving `served`: what each raised."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.weight_transfer_engine = None
    calls = {
        "reload_weights": lambda: worker.reload_weights(),
        "update_weights served": lambda: worker.update_weights({"names": served[:1]}),
        "update_weights unnamed": lambda: worker.update_weights({"handles": []}),
        "update_weights other": lambda: worker.update_weights({"names": ["lm_head.weight"]}),
    }
    said = {}
    for what, call in calls.items():
        try:
            call()
            said[what] = "returned"
        except Exception as e:
            said[what] = f"{type(e).__name__}: {e}"
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("config")
    parser.add_argument("--private-pin", action="store_true")
    parser.add_argument("--version", default="")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--load-format", default="")
    parser.add_argument("--follower-env", default="", help="KEY=VALUE for every rank but 0")
    parser.add_argument("--decide-only", action="store_true")
    parser.add_argument("--lookup", default="", help="on a GPU: save vLLM's lookups here")
    parser.add_argument(
        "--reference", default="", help="the checkpoint's files, where the model's folder has none"
    )
    parser.add_argument(
        "--live", default="", help="after loading, step until the tables move (move_when_told)"
    )
    parser.add_argument(
        "--updates", action="store_true", help="after loading, call vLLM's weight updates"
    )
    args = parser.parse_args()

    if args.follower_env and args.rank:
        key, _, value = args.follower_env.partition("=")
        os.environ[key] = value
    # As vLLM's command line does first: its log handlers, which the plugin's lines use.
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())
    if args.version:
        # The one way to meet a vLLM this plugin does not know, on this machine.
        import vllm.version

        vllm.version.__version__ = args.version
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # vLLM may load plugins again: harmless
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if not args.lookup:
        cpu_only(args.private_pin)
    with open(args.config, "rb") as f:
        config = pickle.load(f)
    if args.load_format:
        config.load_config.load_format = args.load_format
    init_distributed_environment(
        world_size=args.world,
        rank=args.rank,
        distributed_init_method=f"file://{args.init_file}",
        local_rank=args.rank,
        backend="gloo",
    )
    out: dict[str, Any] = {"rank": args.rank}
    with set_current_vllm_config(config):
        initialize_model_parallel(tensor_model_parallel_size=args.world)
        if args.decide_only:
            # The plugin's group decision, over vLLM's own GroupCoordinator (here the
            # TP group; in a served model, the Engram DP group).
            from vllm.distributed import get_tp_group

            from engramd_client.engines.vllm.process import PROCESS
            from engramd_shared.families import ENGRAM

            group = get_tp_group()
            out["serve"] = PROCESS.decide(
                ENGRAM, leader=group.rank_in_group == 0, broadcast=group.broadcast_object
            )
            print(json.dumps(out), flush=True)
            os._exit(0)
        import vllm.models.deepseek_v41.common.engram as engram
        import vllm.models.deepseek_v41.nvidia.model as nvidia_model

        out["patched"] = bool(
            getattr(engram.ParallelEngramEmbedding._allocate_weights, "__engramd__", False)
        )
        out["model_sees_patch"] = (
            nvidia_model.can_share_engram_tables is engram.can_share_engram_tables
        )
        hf = config.model_config.hf_text_config
        started = time.monotonic()
        with torch.device("cuda" if args.lookup else "cpu"):
            net = Net(hf, 1024, 64)
        out["build_s"] = time.monotonic() - started
        layers = {}
        for name, module in net.named_modules():
            if isinstance(module, engram.ParallelEngramEmbedding):
                layer_id = int(name.split(".")[2])
                layers[layer_id] = {
                    "name": name,
                    "start": module.vocab_start_idx,
                    "end": module.vocab_end_idx,
                    "head_start": module.head_start,
                    "heads": module.part_n_hash_cols,
                    "shards": module._get_shard_info()[0],
                    "weight_dtype": str(module.weight.dtype),
                    "scale_dtype": str(module.weight_scale_inv.dtype),
                    "weight_map": mapping_of(module.weight.data_ptr()),
                    "scale_map": mapping_of(module.weight_scale_inv.data_ptr()),
                    "served": bool(getattr(module, "_engramd_served", False)),
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
                LoadConfig(model_loader_extra_config={"enable_weights_track": True})
            )
            group = torch.distributed.group.WORLD
            # One rank at a time: each measures its own reads with a cold cache.
            for turn in range(args.world):
                torch.distributed.barrier(group)
                if turn != args.rank:
                    continue
                drop_cache(folder)
                before, started = io_read_bytes(), time.monotonic()
                loader.load_weights(net, config.model_config)
                out["read_bytes"] = io_read_bytes() - before
                out["load_s"] = time.monotonic() - started
            torch.distributed.barrier(group)
        if args.live:
            from engramd_client.engines.vllm.process import PROCESS

            def addresses() -> dict[str, list[int]]:
                found = {}
                for layer_id, info in layers.items():
                    embedding: Any = net.get_submodule(info["name"])
                    pair = [embedding.weight.data_ptr(), embedding.weight_scale_inv.data_ptr()]
                    found[str(layer_id)] = pair
                return found

            addressed = addresses()
            step = idle_step()
            out["live"] = move_when_told(args.rank, Path(args.live), step, PROCESS.tables)
            out["live"]["same_addresses"] = addresses() == addressed
            for info in layers.values():
                moved: Any = net.get_submodule(info["name"])
                info["weight_map"] = mapping_of(moved.weight.data_ptr())
                info["scale_map"] = mapping_of(moved.weight_scale_inv.data_ptr())
        if args.updates:
            from engramd_client.engines.vllm.process import PROCESS

            out["updates"] = weight_updates(sorted(PROCESS.served))
        if args.lookup:
            torch.save(lookups(net, engram.ParallelEngramEmbedding), args.lookup)
        from safetensors import safe_open

        files = Path(args.reference or config.model_config.model)
        index = json.loads((files / "model.safetensors.index.json").read_text())
        for layer_id, info in layers.items():
            table: Any = net.get_submodule(info["name"])
            same = []
            for suffix, param in (("weight", table.weight), ("scale", table.weight_scale_inv)):
                key = f"layers.{layer_id}.engram.embed.{suffix}"
                with safe_open(files / index["weight_map"][key], "pt") as f:
                    rows = f.get_slice(key)[info["start"] : info["end"]]
                same.append(bool(torch.equal(rows.view(torch.uint8), param.data.view(torch.uint8))))
            info["same_bytes"] = same
            info["anonymous_kib"] = anonymous_kib(table.weight.data_ptr()) + anonymous_kib(
                table.weight_scale_inv.data_ptr()
            )
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
