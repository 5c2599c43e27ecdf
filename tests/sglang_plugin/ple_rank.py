"""One SGLang TP rank on CPU: loads the plugins, builds real Qwen4Exp PLE embeddings, loads
the checkpoint with Qwen4ExpForConditionalGeneration's own load_weights.

    python ple_rank.py RANK WORLD INIT_FILE CHECKPOINT [--backend pinned|file]
        [--offload-dir D] [--no-load] [--load-format F] [--whole-files] [--reference FOLDER]

Everything is SGLang's own code (its plugin loader, runtime context, gloo TP
GroupCoordinator, Qwen4ExpNGramEmbedding with its Qwen4ExpPinnedHostEmbedding
and allocate_ple_host_table, the model's load_weights over its default
safetensors iterator, or runai_streamer's for an s3:// CHECKPOINT whose files are
in FOLDER) except the one call that needs a GPU, replaced in
`cpu_only` with the reason beside it. The layers are SGLang's PLE embeddings
under the names the model gives them (model.layers.K.ple.ple_embedding), with
one ordinary weight beside each (value_proj) for the loader to load. Prints one
JSON line with what each PLE table holds and what the weight loading read.
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
    io_write_bytes,
    mapping_of,
    move_when_told,
)
from sglang_plugin.sglang_rank import cached_bytes  # noqa: E402
from torch import nn  # noqa: E402


def cpu_only() -> None:
    """Replace the calls that need a GPU; nothing else of SGLang's."""
    import sglang.srt.models.qwen4_exp_ple_table as ple_table

    class Torch:
        """torch for SGLang's PLE table module, whose pinned allocation needs a CUDA runtime."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return torch.empty(*args, **kwargs)

    ple_table.torch = Torch()


class Holder(nn.Module):
    """A place in the module tree (a decoder layer, its PLE block)."""


class Net(nn.Module):
    """SGLang's PLE embeddings under Qwen4Exp's names, loaded by
    Qwen4ExpForConditionalGeneration's own load_weights (what it reads of the model
    besides the modules: its config, PP group and layer span)."""

    def __init__(self, config: Any, folder_config: Any) -> None:
        super().__init__()
        from sglang.srt.models.qwen4_exp import (
            Qwen4ExpForConditionalGeneration,
            Qwen4ExpNGramEmbedding,
        )

        layers = nn.ModuleList()
        ple_ids = sorted(set(config.ple_layer_ids))
        for layer_id in range(config.num_hidden_layers):
            layer = Holder()
            if layer_id + 1 in ple_ids:
                ple = Holder()
                ple.ple_embedding = Qwen4ExpNGramEmbedding(
                    config,
                    config.ple_embed_dim,
                    ple_layer_index=ple_ids.index(layer_id + 1),
                    prefix=f"model.language_model.layers.{layer_id}.ple.ple_embedding",
                )
                ple.value_proj = Holder()
                ple.value_proj.weight = nn.Parameter(
                    torch.zeros(config.hidden_size, config.ple_embed_dim, dtype=torch.bfloat16),
                    requires_grad=False,
                )
                layer.ple = ple
            layers.append(layer)
        inner = Holder()
        inner.layers = layers
        self.model = inner
        self.config = folder_config
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.language_model_only = True
        self.pp_group = type("PP", (), {"is_first_rank": True, "is_last_rank": True})()
        self._load = Qwen4ExpForConditionalGeneration.load_weights
        self._load_qwen4_exp_ple_buffer = (
            Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer.__get__(self)
        )

    def load_weights(self, weights: Any) -> Any:
        return self._load(self, weights)


def table_ranges(folder: Path) -> dict[Path, list[tuple[int, int]]]:
    """Each checkpoint file's PLE shards' byte ranges, from its safetensors header."""
    import struct

    ranges: dict[Path, list[tuple[int, int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        ranges[path] = [
            (8 + size + entry["data_offsets"][0], 8 + size + entry["data_offsets"][1])
            for name, entry in header.items()
            if ".ngram_embedding.shard_" in name
        ]
    return ranges


def checkpoint_rows(folder: Path, layer_id: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the layer's table: the checkpoint's shards, back to back."""
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    prefix = f"model.language_model.layers.{layer_id}.ple.ple_embedding.ngram_embedding.shard_"
    shards = sorted(
        (n for n in index["weight_map"] if n.startswith(prefix)),
        key=lambda n: int(n[len(prefix) :].split(".")[0]),
    )
    parts = []
    for name in shards:
        with safe_open(folder / index["weight_map"][name], "pt") as f:
            parts.append(f.get_tensor(name))
    return torch.cat(parts)[start:stop]


def file_backend(table: Any, rows: torch.Tensor) -> dict[str, Any]:
    """What SGLang's file backend runs beside the gather, on the layer's table: a prefill's
    prefetch, its resident-set trimmer (SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB), then whether
    the rows read the same."""
    weight = table.weight.data
    prefetcher, trimmer = table._file_prefetcher, table._file_rss_trimmer
    ids = torch.arange(
        table.shard_indices.org_vocab_start_index, table.shard_indices.org_vocab_end_index
    )
    queued = prefetcher is not None and prefetcher.enqueue(
        ids.repeat(2048 // len(ids) + 1),
        vocab_start=table.shard_indices.org_vocab_start_index,
        vocab_end=table.shard_indices.org_vocab_end_index,
    )
    freed = trimmer.trim_once() if trimmer is not None else 0
    return {
        "prefetcher": type(prefetcher).__name__,
        "prefetch_queued": bool(queued),
        "trimmed_bytes": freed,
        "same_after_trim": bool(
            torch.equal(rows.view(torch.uint8), weight[: len(rows)].view(torch.uint8))
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument(
        "--live", default="", help="after loading, step until the tables move (move_when_told)"
    )
    parser.add_argument("world", type=int)
    parser.add_argument("init_file")
    parser.add_argument("checkpoint")
    parser.add_argument("--backend", default="pinned")
    parser.add_argument("--offload-dir", default="")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--whole-files", action="store_true", help="load with disable_mmap")
    parser.add_argument(
        "--reference", default="", help="the checkpoint's files, where CHECKPOINT is a URL"
    )
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    load_plugins()  # once per process, whoever calls it again
    # SGLang's model runner imports its loader before its model registry imports the models.
    import sglang.srt.model_loader.loader as loader
    import torch.distributed as dist
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    cpu_only()
    publish(
        ServerArgs(
            model_path=args.checkpoint,
            load_format=args.load_format,
            tp_size=args.world,
            skip_tokenizer_init=True,
            device="cpu",
            # Qwen4Exp's Mamba cache strategy asks the GPU platform otherwise.
            disable_radix_cache=True,
            ple_offload_embedding=True,
            ple_offload_backend=args.backend,
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
    import sglang.srt.models.qwen4_exp as qwen4_exp

    from engramd_client.engines.common import replaced

    out: dict[str, Any] = {"rank": args.rank}
    out["patched"] = replaced(qwen4_exp.allocate_ple_host_table)
    out["iterator_patched"] = replaced(loader.buffered_multi_thread_safetensors_weights_iterator)

    folder = Path(args.reference or args.checkpoint)
    document = json.loads((folder / "config.json").read_text())
    config = Qwen4ExpTextConfig(**document["text_config"])
    # What SGLang's load_model_with_memory_saver sets on the text config for Qwen4Exp.
    config.ple_offload_embedding = True
    config.ple_offload_backend = args.backend
    config.ple_offload_dir = args.offload_dir or None
    folder_config = type(
        "Config", (), {"text_config": config, "tie_word_embeddings": False, "num_experts": None}
    )()
    if args.backend == "file":
        # What SGLang's loader runs first on CUDA (load_model_utils; skipped by its own
        # variable where no device reads host page tables, as here).
        from sglang.srt.models.qwen4_exp_ple_table import check_file_backend_supported

        check_file_backend_supported(0)
    written, started = io_write_bytes(), time.monotonic()
    net = Net(config, folder_config)
    out["build_s"] = time.monotonic() - started
    if not args.no_load and args.load_format == "runai_streamer":
        from sglang.srt.model_loader import weight_utils
        from sglang.srt.utils.runai_utils import list_safetensors

        # What the runai_streamer loader streams (its module's binding, which the plugin
        # replaced); not distributed: that broadcasts over a GPU's collectives.
        started = time.monotonic()
        loaded = net.load_weights(
            weight_utils.runai_safetensors_weights_iterator(
                list_safetensors(args.checkpoint), False, "cpu"
            )
        )
        out["load_s"] = time.monotonic() - started
        out["loaded"] = sorted(n for n in loaded if ".ple." in n)
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
            loaded = net.load_weights(
                loader.buffered_multi_thread_safetensors_weights_iterator(
                    files, max_workers=2, disable_mmap=args.whole_files
                )
            )
            out["read_bytes"] = io_read_bytes() - before
            out["load_s"] = time.monotonic() - started
            out["write_bytes"] = io_write_bytes() - written
            out["loaded"] = sorted(n for n in loaded if ".ple." in n)
            out["table_bytes_cached"] = sum(
                cached_bytes(path, lo, hi)
                for path, spans in table_ranges(folder).items()
                for lo, hi in spans
            )
        group.barrier()
    if args.live:
        from engramd_client.engines.sglang.process import PROCESS

        def addresses() -> dict[str, Any]:
            found = {}
            for layer_id in range(config.num_hidden_layers):
                if layer_id + 1 in config.ple_layer_ids:
                    ple: Any = net.get_submodule(f"model.layers.{layer_id}.ple")
                    found[str(layer_id)] = ple.ple_embedding.ngram_embedding.weight.data_ptr()
            return found

        addressed = addresses()
        # SGLang's step seam (Scheduler.run_batch) does not import here (no setproctitle in
        # this venv): the plugin's hook it calls first is called instead.
        out["live"] = move_when_told(args.rank, Path(args.live), PROCESS.step, PROCESS.tables)
        out["live"]["same_addresses"] = addresses() == addressed
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    found = {}
    for layer_id in range(config.num_hidden_layers):
        if layer_id + 1 not in config.ple_layer_ids:
            continue
        block: Any = net.get_submodule(f"model.layers.{layer_id}.ple")
        table: Any = block.ple_embedding.ngram_embedding
        weight = table.weight.data
        shard = table.shard_indices
        start = shard.padded_org_vocab_start_index
        end = start + table.num_embeddings_per_partition
        real = shard.org_vocab_end_index - shard.org_vocab_start_index
        info: dict[str, Any] = {
            "type": type(table).__name__,
            "start": start,
            "end": end,
            "org": [shard.org_vocab_start_index, shard.org_vocab_end_index],
            "org_vocab_size": table.org_vocab_size,
            "shape": list(weight.shape),
            "dtype": str(weight.dtype),
            "map": mapping_of(weight.data_ptr()),
        }
        if not args.no_load:
            expected = checkpoint_rows(folder, layer_id, start, end)
            info["same_bytes"] = bool(
                torch.equal(expected.view(torch.uint8), weight[:real].view(torch.uint8))
            )
            info["padding_zero"] = bool((weight[real:].view(torch.uint8) == 0).all())
            info["padding_map"] = mapping_of(weight[real:].data_ptr()) if real < len(weight) else ""
            info["anonymous_kib"] = anonymous_kib(weight.data_ptr())
            key = f"model.language_model.layers.{layer_id}.ple.value_proj.weight"
            with safe_open(folder / index["weight_map"][key], "pt") as f:
                info["value_proj_loaded"] = bool(
                    torch.equal(f.get_tensor(key), block.value_proj.weight)
                )
            info["weight_scale"] = float(table.weight_scale.float().item())
            if args.backend == "file":
                info.update(file_backend(table, expected[:real]))
        found[str(layer_id)] = info
    out["layers"] = found
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
