"""One SGLang TP rank on CPU: loads the plugins, builds real Engram layers, loads the checkpoint.

    python sglang_rank.py RANK WORLD INIT_FILE CHECKPOINT [--layout per_rank|shared]
        [--version V] [--no-load] [--load-format F] [--decide-only] [--follower-env K=V]
        [--reference FOLDER]

Everything is SGLang's own code (its plugin loader and HookRegistry, its
runtime context and TP GroupCoordinator on gloo, its Engram layers and host
tables, DeepseekV4ForCausalLM.load_weights over its default safetensors
iterator) except the few calls that need a GPU, replaced in `cpu_only`
with the reason beside each. Prints one JSON line with what the rank holds
and what its weight loading read.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import tvshim  # noqa: E402, F401 (before anything imports sglang)
from engine_harness import (  # noqa: E402
    anonymous_kib,
    drop_cache,
    io_read_bytes,
    mapping_of,
    move_when_told,
)
from sglang_plugin.sglang_harness import engram_config  # noqa: E402
from torch import nn  # noqa: E402


def cpu_only() -> None:
    """Replace the calls that need a GPU; nothing else of SGLang's."""
    import sglang.srt.layers.engram as engram

    class Cudart:
        # SGLang's own host tables register their pages with CUDA; CPU torch has no cudart.
        def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
            return 0

    torch.cuda.cudart = lambda: Cudart()
    # No device: the host-table set-up asks for the current one.
    torch.cuda.current_device = lambda: 0
    # Whether the GPU reads host memory through ATS: a cuda.bindings driver query.
    engram._sorted_host_reads = lambda device: False


class Layer(nn.Module):
    """A decoder layer's place for its Engram (SGLang's own Engram layer)."""

    def __init__(self, engram: nn.Module | None) -> None:
        super().__init__()
        if engram is not None:
            self.engram = engram


class Net(nn.Module):
    """The Engram layers under DeepSeek-V4's names, loaded by DeepseekV4ForCausalLM's own
    load_weights (what it needs besides the layers: its config, PP group, no MoE)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

        inner: Any = nn.Module()
        inner.layers = nn.ModuleList(layers)
        inner.start_layer, inner.end_layer = 0, len(layers)
        self.model = inner
        self.config = type(
            "Config",
            (),
            {
                "n_routed_experts": 1,
                "num_hidden_layers": len(layers),
                "num_nextn_predict_layers": 0,
                "model_type": "deepseek_v41",
            },
        )()
        self.wo_a_fp8, self.quant_config, self.num_fused_shared_experts = False, None, 0
        self.vision = None
        self.pp_group = type("PP", (), {"is_first_rank": True, "is_last_rank": True})()
        self._load = DeepseekV4ForCausalLM.load_weights
        self.remap_weight_name_to_dpsk_hf_format = (
            DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
        )

    def load_weights(self, weights: Any) -> Any:
        return self._load(self, weights)

    def post_load_weights(self, **kwargs: Any) -> None:
        """Attention and MHC set-up: no such modules here."""

    def _prewarm_mhc_kernels(self) -> None:
        """MHC kernels' JIT warm-up: needs a GPU, no MHC here."""


def cached_bytes(path: Path, start: int, stop: int) -> int:
    """Bytes of `path`'s pages over [start, stop) in the page cache (mincore), whoever read them."""
    import ctypes
    import mmap

    import numpy as np

    page = mmap.PAGESIZE
    first = start // page * page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        last = min(-(-stop // page) * page, len(m))
        pages = -(-(last - first) // page)
        resident = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        address = np.frombuffer(m, dtype=np.uint8).ctypes.data + first
        if libc.mincore(ctypes.c_void_p(address), last - first, resident) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(1 for r in resident if r & 1) * page


def table_ranges(folder: Path) -> dict[Path, list[tuple[int, int]]]:
    """Each checkpoint file's Engram table byte ranges, from its safetensors header."""
    import struct

    ranges: dict[Path, list[tuple[int, int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        ranges[path] = [
            (8 + size + entry["data_offsets"][0], 8 + size + entry["data_offsets"][1])
            for name, entry in header.items()
            if ".engram.embed." in name
        ]
    return ranges


def lookups(net: nn.Module, layer_ids: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Each Engram table's lookup of random valid ids (SGLang's Triton gather, on the GPU)."""
    found = {}
    for layer_id in layer_ids:
        embed: Any = net.get_submodule(f"model.layers.{layer_id}.engram.embed")
        g = torch.Generator().manual_seed(layer_id)
        ids = torch.randint(embed.row_start, embed.row_start + embed.rows, (257, 6), generator=g)
        found[layer_id] = embed._owned_rows(ids.cuda()).cpu()
    return found


def weight_updates() -> dict[str, str]:
    """SGLang's ModelRunner weight updates on this rank (its WeightUpdater): what each
    answered, or raised."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from engramd_client.engines.sglang.process import PROCESS

    served = sorted(PROCESS.served)[0]
    updater = WeightUpdater.__new__(WeightUpdater)
    rows = torch.zeros(1, 8, dtype=torch.uint8)
    calls = {
        "update_weights_from_disk": lambda: updater.update_weights_from_disk("/x", "auto"),
        "update_weights_from_ipc": lambda: updater.update_weights_from_ipc(None),
        "update_weights_from_tensor": lambda: updater.update_weights_from_tensor([(served, rows)]),
        "update_weights_from_distributed": lambda: updater.load_weights_from_distributed(
            [(served, rows)]
        ),
        "other": lambda: updater.load_weights_from_distributed([("lm_head.weight", rows)]),
    }
    said = {}
    for what, call in calls.items():
        try:
            said[what] = repr(call())
        except Exception as e:
            said[what] = f"{type(e).__name__}: {e}"
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument(
        "--live", default="", help="after loading, step until the tables move (move_when_told)"
    )
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("checkpoint")
    parser.add_argument("--layout", default="per_rank")
    parser.add_argument("--version", default="")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--follower-env", default="", help="KEY=VALUE for every rank but 0")
    parser.add_argument("--decide-only", action="store_true")
    parser.add_argument("--lookup", default="", help="on a GPU: save SGLang's lookups here")
    parser.add_argument(
        "--reference", default="", help="the checkpoint's files, where CHECKPOINT is a URL"
    )
    parser.add_argument(
        "--updates", action="store_true", help="after loading, call SGLang's weight updates"
    )
    args = parser.parse_args()

    if args.follower_env and args.rank:
        key, _, value = args.follower_env.partition("=")
        os.environ[key] = value
    os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = args.layout
    # As SGLang's server configures its log first: the plugin's lines go through it.
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    if args.version:
        # The one way to meet an SGLang this plugin does not know, on this machine.
        import sglang.version

        sglang.version.__version__ = args.version
    from sglang.srt.plugins import load_plugins

    load_plugins()
    load_plugins()  # once per process, whoever calls it again
    import sglang.srt.layers.engram as engram
    import sglang.srt.model_loader.loader as loader
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    if not args.lookup:
        cpu_only()
    publish(
        ServerArgs(
            model_path=args.checkpoint,
            load_format=args.load_format,
            tp_size=args.world,
            skip_tokenizer_init=True,
            device="cpu",
        ),
        role="scheduler",
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world
    )
    group = GroupCoordinator(
        [list(range(args.world))],
        args.rank,
        "gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="tp",
    )
    get_parallel().override_permanently(tp_size=args.world, tp_rank=args.rank, tp_group=group)
    out: dict[str, Any] = {"rank": args.rank}
    table = engram.EngramEmbedding
    out["patched"] = hasattr(table._init_host_table, "__wrapped__")
    out["iterator_patched"] = hasattr(
        loader.buffered_multi_thread_safetensors_weights_iterator, "__wrapped__"
    )
    if args.decide_only:
        from engramd_client.engines.sglang import deepseek

        out["serve"] = deepseek._decide()
        print(json.dumps(out), flush=True)
        os._exit(0)

    bare = engram.EngramLayout.from_config(engram_config((0,) * 3))
    assert bare is not None
    rows = tuple(bare.column_bounds(i)[-1] for i in range(len(bare.layer_ids)))
    config = engram_config(rows)
    layout = engram.EngramLayout.from_config(config)
    assert layout is not None
    started = time.monotonic()
    layers: list[nn.Module] = []
    for layer_id in range(max(layout.layer_ids) + 1):
        block = None
        if layer_id in layout.layer_ids:
            block = engram.Engram(config, layer_id, layout, prefix=f"model.layers.{layer_id}")
        layers.append(Layer(block))
    net = Net(layers)
    out["build_s"] = time.monotonic() - started
    folder = Path(args.reference or args.checkpoint)
    if not args.no_load and args.load_format == "runai_streamer":
        from sglang.srt.model_loader import weight_utils
        from sglang.srt.utils.runai_utils import list_safetensors

        # What the runai_streamer loader streams (its module's binding, which the plugin
        # replaced); not distributed: that broadcasts over a GPU's collectives.
        started = time.monotonic()
        streamed = weight_utils.runai_safetensors_weights_iterator(
            list_safetensors(args.checkpoint), False, "cpu"
        )
        net.load_weights(streamed)
        out["load_s"] = time.monotonic() - started
    elif not args.no_load:
        files = sorted(glob.glob(str(folder / "*.safetensors")))
        # One rank at a time: each measures its own reads with a cold cache.
        for turn in range(args.world):
            group.barrier()
            if turn != args.rank:
                continue
            drop_cache(folder)
            before, started = io_read_bytes(), time.monotonic()
            # What DefaultModelLoader._get_weights_iterator uses by default
            # (enable_multithread_load), through the loader module's own binding.
            net.load_weights(
                loader.buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2)
            )
            out["read_bytes"] = io_read_bytes() - before
            out["load_s"] = time.monotonic() - started
            # The tables' pages in the page cache right after this rank's load: what it read
            # of them (and around them), whatever else the process read meanwhile.
            out["table_bytes_cached"] = sum(
                cached_bytes(path, lo, hi)
                for path, spans in table_ranges(folder).items()
                for lo, hi in spans
            )
        group.barrier()
    if args.lookup:
        torch.save(lookups(net, layout.layer_ids), args.lookup)
    if args.updates:
        out["updates"] = weight_updates()
    if args.live:
        from engramd_client.engines.sglang.process import PROCESS

        def addresses() -> dict[str, Any]:
            found = {}
            for layer_id in layout.layer_ids:
                embed: Any = net.get_submodule(f"model.layers.{layer_id}.engram.embed")
                found[str(layer_id)] = list(embed._table_ptrs())
            return found

        addressed = addresses()
        # SGLang's step seam (Scheduler.run_batch) does not import here (no setproctitle in
        # this venv): the plugin's hook it calls first is called instead.
        out["live"] = move_when_told(args.rank, Path(args.live), PROCESS.step, PROCESS.tables)
        out["live"]["same_addresses"] = addresses() == addressed
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    found = {}
    for layer_id in layout.layer_ids:
        embed: Any = net.get_submodule(f"model.layers.{layer_id}.engram.embed")
        start, end = embed.row_start, embed.row_start + embed.rows
        weight, scale = embed.weight.data, embed.scale.data
        info: dict[str, Any] = {
            "start": start,
            "end": end,
            "served": bool(getattr(embed, "_engramd_served", False)),
            "host_table": type(embed.host_table).__name__,
            "shape": list(weight.shape),
            "weight_dtype": str(weight.dtype),
            "scale_dtype": str(scale.dtype),
            "weight_map": mapping_of(weight.data_ptr()),
            "scale_map": mapping_of(scale.data_ptr()),
            "pointers_are_tensors": list(embed._table_ptrs())
            == [weight.data_ptr(), scale.data_ptr()],
        }
        whole = embed.host_table is not None and embed.host_table.layout == "shared"
        same = []
        for suffix, param in (("weight", weight), ("scale", scale)):
            key = f"layers.{layer_id}.engram.embed.{suffix}"
            with safe_open(folder / index["weight_map"][key], "pt") as f:
                expected = f.get_slice(key)[:] if whole else f.get_slice(key)[start:end]
            same.append(bool(torch.equal(expected.view(torch.uint8), param.view(torch.uint8))))
        info["same_bytes"] = same
        if not args.no_load:
            info["anonymous_kib"] = anonymous_kib(weight.data_ptr()) + anonymous_kib(
                scale.data_ptr()
            )
        found[str(layer_id)] = info
    out["layers"] = found
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
