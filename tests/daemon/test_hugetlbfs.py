"""Huge pages: a shm folder on hugetlbfs (2 MiB and 1 GiB pages), memfds on hugetlb pages.

Each test reserves the pages it needs (tests/conftest.py huge_pages) and
gives the old count back; 1 GiB pages are skipped only where the kernel
grants none.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
from backing_fill import NO_FD_STORE, check_descriptors, copy_in

from conftest import Worker, huge_pages, mounted_hugetlbfs
from engramd.backings import HugetlbfsBacking
from engramd.backings.memfd import SEALS
from engramd.config import DaemonConfig
from engramd.host.hugepages import pool
from engramd_client import plan_tables
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import PACKED_NAME, read_manifest, sets_root
from engramd_shared.pb import engramd_pb2 as pb
from helpers import attach_error, memfd_mappings, reason, reference_digests, set_folders

MiB = 1 << 20
GiB = 1 << 30


def test_hugetlbfs_backing_bookkeeping(checkpoint: Path) -> None:
    plan = plan_tables(checkpoint)
    with huge_pages(2 * MiB, 32) as granted, mounted_hugetlbfs(2 * MiB) as shm:
        assert granted == 32, f"asked the kernel for 32 pages of 2 MiB, got {granted}"
        backing = HugetlbfsBacking.from_config(DaemonConfig(shm_dir=str(shm)), None, NO_FD_STORE)
        backing.claim()
        usage = backing.usage()
        assert usage.page_size == 2 * MiB and usage.total >= usage.free >= 32 * 2 * MiB
        sizes = [t.nbytes for t in plan.tensors]
        # Packed: the small scale tensors share pages with the big tables.
        footprint = backing.footprint(sizes)
        assert footprint % (2 * MiB) == 0 and footprint < sum(backing.reserved(n) for n in sizes)
        with pytest.raises(ShmCapacityError, match="nr_hugepages"):
            backing.check_capacity(usage.free + 2 * MiB, "set x")
        free_before = pool(2 * MiB).free
        manifest = copy_in(backing, plan)
        assert pool(2 * MiB).free == free_before - footprint
        folder = sets_root(shm) / plan.set_id
        assert [p.name for p in folder.iterdir()] == [PACKED_NAME]
        assert read_manifest(folder, os.geteuid()) == manifest  # from the file's trailer
        assert backing.adopt() == [manifest]
        assert [backing.checksum(manifest, i) for i in range(len(sizes))] == [
            t.checksum for t in manifest.tensors
        ]
        check_descriptors(backing, manifest, plan)
        backing.remove(plan.set_id)
        assert pool(2 * MiB).free == free_before


def test_daemon_on_hugetlbfs_serves_by_fd_and_path_and_adopts_after_a_kill(
    checkpoint: Path, daemons: Any, workers: list[Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = reference_digests(checkpoint)
    with huge_pages(2 * MiB, 32), mounted_hugetlbfs(2 * MiB) as shm:
        d = daemons("--checkpoint", str(checkpoint), shm=shm)
        try:
            [s] = d.status().sets
            assert (s.backing, s.page_size) == ("hugetlbfs", 2 * MiB)
            assert d.status().backings[0].name == "hugetlbfs"
            by_fd = Worker(checkpoint, d.socket, share="on")
            monkeypatch.setenv("ENGRAMD_HANDLES", "shm")
            by_path = Worker(checkpoint, d.socket, share="on")
            workers += [by_fd, by_path]
            for w in workers:
                assert w.hello["mode"] == "shared" and w.hello["digests"] == expected
            d.stop(signal.SIGKILL)
            d.start()
            [s] = d.status().sets
            assert s.adopted and d.log.count("loading set") == 1
            for w in workers:
                assert w.ask("digest")["digests"] == expected
                assert w.exit() == 0
        finally:
            d.stop()


@pytest.mark.parametrize("numa", ["", "node:0"])
def test_a_set_beyond_the_free_huge_pages_is_refused_before_copying(
    checkpoint: Path, daemons: Any, numa: str
) -> None:
    plan = plan_tables(checkpoint)
    with huge_pages(2 * MiB, 4), mounted_hugetlbfs(2 * MiB) as shm:
        d = daemons("--allow-root", str(checkpoint.parent), "--numa", numa, shm=shm)
        try:
            free = pool(2 * MiB).free
            err = attach_error(d, pb.AttachRequest(set_id=plan.set_id, checkpoint=str(checkpoint)))
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason(err) == "capacity"
            details = str(err.details())
            assert "nr_hugepages" in details and "hugepages=" in details, details
            # Bound to a node, the node's own pool is what counts.
            assert ("/node0/hugepages/" in details) == (numa == "node:0"), details
            assert pool(2 * MiB).free == free and list(set_folders(shm)) == []
        finally:
            d.stop()


def test_one_gib_pages_hold_a_packed_set(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    with huge_pages(GiB, 1) as granted:
        if granted < 1:
            pytest.skip("asked the kernel for 1 page of 1 GiB at run time and got 0")
        with mounted_hugetlbfs(GiB) as shm:
            d = daemons("--checkpoint", str(checkpoint), shm=shm)
            try:
                [s] = d.status().sets
                assert s.page_size == GiB
                # 21 MB of tables and scales, packed: one page, not one per tensor.
                assert pool(GiB).total - pool(GiB).free == GiB
                w = Worker(checkpoint, d.socket, share="on")
                workers.append(w)
                assert w.hello["digests"] == reference_digests(checkpoint)
                assert w.exit() == 0
            finally:
                d.stop()


def test_memfd_on_huge_pages(checkpoint: Path, daemons: Any, workers: list[Worker]) -> None:
    with huge_pages(2 * MiB, 32):
        d = daemons("--backing", "memfd", "--page-size", "2M", "--checkpoint", str(checkpoint))
        try:
            [s] = d.status().sets
            assert (s.backing, s.page_size) == ("memfd", 2 * MiB)
            w = Worker(checkpoint, d.socket, share="on")
            workers.append(w)
            assert w.hello["digests"] == reference_digests(checkpoint)
            [mapping, *_] = memfd_mappings(w.proc.pid)
            fd = os.open(f"/proc/{w.proc.pid}/map_files/{mapping}", os.O_RDONLY)
            try:
                assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
                assert os.fstat(fd).st_blksize == 2 * MiB  # hugetlb pages
            finally:
                os.close(fd)
            assert w.exit() == 0
        finally:
            d.stop()
