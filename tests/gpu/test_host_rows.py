"""PLE rows read on the host for a GPU (ENGRAMD_DISK_OFFLOAD): staged in pinned memory and
copied, or read in place by a device that uses the host's page tables.

The rows come from a real daemon's disk-backed set (`--backing disk`), attached
with no device (nothing registered or pinned), as the vLLM plugin attaches them.
Skipped with the reason where this process sees no CUDA device, or (the in-place
read) where the device does not read pageable memory through the host's page
tables.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_cuda_views import GPU_ONLY

from engramd.testing.pagecache import evict
from engramd.testing.synth import PleSpec, expected_ple_rows, synthesize_ple
from engramd_client import attach
from engramd_client.rowread import HostRows, RowReader
from engramd_shared.checkpoint import plan_tables
from engramd_shared.families import PLE

pytestmark = GPU_ONLY

SPEC = PleSpec(layers=(0,), rows=40_000, dim=64, parts=7, fmt="BF16", files=2)
#: The ETP rank's rows [START, STOP) of the table, across shard boundaries.
START, STOP = 10_000, 30_000


@pytest.fixture
def on_disk(tmp_path: Path, daemons: Any) -> Any:
    """The table of a daemon's disk-backed set, rows [START, STOP) attached with no device."""
    folder = tmp_path / "ckpt"
    synthesize_ple(folder, SPEC)
    disk = tmp_path / "tables"
    disk.mkdir()
    d = daemons("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(folder))
    (name,) = [t.name for t in plan_tables(folder, PLE.selection).tensors]
    tables = attach(
        folder, tensors=PLE.selection, rows={name: (START, STOP)}, share=True, socket=str(d.socket)
    )
    yield SimpleNamespace(tables=tables, name=name, disk=disk)
    tables.close()


def _want(ids: torch.Tensor) -> torch.Tensor:
    rows = expected_ple_rows(SPEC, 0, "weight", ids.clamp(0, SPEC.rows - 1))
    return torch.where(((ids >= START) & (ids < STOP)).unsqueeze(1), rows, 0)


def test_staged_rows_copied_to_the_device_are_the_tables(on_disk: Any) -> None:
    table = on_disk.tables[on_disk.name]
    assert on_disk.tables.device is None
    reader = RowReader(HostRows.of_tensor(table, first_row=START), START, STOP, pin=True)
    ids = torch.randint(0, SPEC.rows, (4096,))
    staged = reader.gather(ids, out=reader.staging(ids.numel()))
    assert staged.is_pinned()
    on_device = torch.empty_like(staged, device="cuda")
    on_device.copy_(staged, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), _want(ids))
    reader.close()


def test_the_plugins_lookup_stages_and_copies_on_the_lookups_stream(on_disk: Any) -> None:
    from engramd_client.engines.vllm import ple_rows

    table = on_disk.tables[on_disk.name]
    # What vLLM's pinned-host PLE layer gives the lookup: its width, lookup dtype and rows.
    layer = SimpleNamespace(
        embedding_dim=table.shape[1],
        embedding_method=SimpleNamespace(lookup_dtype=lambda layer: table.dtype),
        shard_indices=SimpleNamespace(org_vocab_start_index=START, org_vocab_end_index=STOP),
    )
    ple_rows.attach_host_table(layer, "weight", HostRows.of_tensor(table, START), False)
    stream = torch.cuda.Stream()
    for _ in range(3):
        ids = torch.randint(0, SPEC.rows, (512, 2), device="cuda")
        # As vLLM's start_prefetch: the side stream waits for the ids, then looks them up.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = ple_rows.lookup(layer, ids, None)
        stream.synchronize()
        assert out.device.type == "cuda" and out.shape == (512, 2, table.shape[1])
        got = out.view(torch.uint8).reshape(ids.numel(), -1).cpu()
        assert torch.equal(got, _want(ids.reshape(-1).cpu()))


def test_a_device_on_the_host_page_tables_reads_the_faulted_in_rows_in_place(on_disk: Any) -> None:
    from engramd_client.cuda import ROUTES, device_caps
    from engramd_shared.pb import engramd_pb2 as pb

    if not device_caps(0).host_page_tables:
        pytest.skip("cuda:0 does not read pageable memory through the host's page tables")
    tables = on_disk.tables
    tables.register_on(0, ROUTES[pb.GPU_ROUTE_HOST_PAGE_TABLES])
    view = tables.cuda(on_disk.name)
    table = tables[on_disk.name]
    assert view.data_ptr() == table.data_ptr()
    reader = RowReader(HostRows.of_tensor(table, first_row=START), START, STOP)
    ids = torch.randint(START, STOP, (4096,))
    evict(on_disk.disk)
    reader.fault_in(ids)
    got = torch.index_select(view, 0, (ids - START).cuda()).view(torch.uint8).cpu()
    assert torch.equal(got, _want(ids))
    reader.close()
