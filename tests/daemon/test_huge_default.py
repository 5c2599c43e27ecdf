"""2 MiB pages for the shared copy by default: the daemon's own huge-page tmpfs over its sets root.

Run as root in the host's mount namespace, the daemon mounts a tmpfs with
huge=within_size over <shm_dir>/engramd; elsewhere it stays on 4 KiB pages
and says why, with the fix. Status reports the pages the kernel really maps,
which the tests compute independently: huge=within_size gives every whole
2 MiB of a file a huge page and its tail 4 KiB pages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import Worker, mounted_tmpfs, wait_until
from engramd.backings import TmpfsBacking
from engramd.cli.status_view import render
from engramd.host.hugeroot import claim_huge_root, unmount_below
from engramd.host.pagesize import census
from engramd.host.shmfs import find_mount, is_mount_point, mounts_below, shmem_enabled
from engramd.sets.loader import LoadProgress, load_set
from engramd_client import plan_tables
from engramd_shared.errors import ShmCapacityError
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from helpers import attach_error, reason, reference_digests, set_folders

MiB = 1 << 20
HUGE = 2 * MiB


def _expected_huge_bytes(checkpoint: Path) -> int:
    """Bytes huge=within_size puts on 2 MiB pages: each tensor file's whole 2 MiB chunks."""
    return sum(t.nbytes // HUGE * HUGE for t in plan_tables(checkpoint).tensors)


def _needs_mount(shm: Path) -> None:
    """Skip where this process may not mount a tmpfs, as the daemon would not either."""
    probe = shm / "probe"
    probe.mkdir()
    try:
        why = claim_huge_root(str(shm), probe, None, enabled=True)
    finally:
        unmount_below(probe)
        probe.rmdir()
    if why:
        pytest.skip(f"the daemon cannot mount a huge tmpfs here: {why}")


def _ready(d: Any) -> pb.SetInfo:
    """The daemon's one set, once it measured its pages (right after the set is ready)."""
    found: list[pb.SetInfo] = []

    def measured() -> bool:
        found[:] = [s for s in d.status().sets if s.HasField("huge_page_bytes")]
        return bool(found)

    wait_until(measured, 30, "the daemon to report the set's pages")
    return found[0]


def test_default_daemon_mounts_huge_tmpfs_and_status_measures_the_pages(
    checkpoint: Path, shm_dir: Path, daemons: Any, workers: list[Worker], monkeypatch: Any
) -> None:
    _needs_mount(shm_dir)
    d = daemons("--checkpoint", str(checkpoint))
    root = sets_root(shm_dir)
    mount = find_mount(root)
    assert mount.point == root and mount.fstype == "tmpfs"
    assert {"huge=within_size", "nosuid", "nodev", "noexec"} <= mount.options, mount.options
    assert (root.stat().st_mode & 0o777) == 0o750 and root.stat().st_uid == os.geteuid()

    s = _ready(d)
    assert s.huge_page_bytes == _expected_huge_bytes(checkpoint) > 0
    assert s.page_size == HUGE
    [backing] = d.status().backings
    assert backing.small_pages_reason == "" and backing.page_size == HUGE
    # Sized as the shm folder, whose free space it still counts against.
    assert backing.total_bytes == os.statvfs(shm_dir).f_blocks * os.statvfs(shm_dir).f_frsize
    assert backing.used_bytes >= s.bytes

    # Descriptors (the default) and paths (workers that share the daemon's view) both read it.
    by_fd = Worker(checkpoint, d.socket, share="on")
    workers.append(by_fd)
    monkeypatch.setenv("ENGRAMD_HANDLES", "shm")
    by_path = Worker(checkpoint, d.socket, share="on")
    workers.append(by_path)
    for w in (by_fd, by_path):
        assert w.hello["mode"] == "shared", w.hello
        assert w.ask("lookups 0.2")["bad"] == 0
    assert by_fd.hello["digests"] == by_path.hello["digests"]
    kinds = sorted(lease.kind for lease in d.status().sets[0].leases)
    assert kinds == sorted([pb.HANDLE_KIND_FD, pb.HANDLE_KIND_SHM])
    for w in (by_fd, by_path):
        assert w.exit() == 0


def test_restart_reuses_the_mount_and_adopts_its_sets(
    checkpoint: Path, shm_dir: Path, daemons: Any
) -> None:
    _needs_mount(shm_dir)
    first = daemons("--checkpoint", str(checkpoint))
    loaded = _ready(first)
    assert first.stop(signal.SIGTERM) == 0
    root = sets_root(shm_dir)
    assert is_mount_point(root), "the mount went with the daemon"

    second = daemons("--checkpoint", str(checkpoint))
    s = _ready(second)
    assert s.adopted and s.set_id == loaded.set_id
    assert s.huge_page_bytes == loaded.huge_page_bytes > 0
    assert mounts_below(shm_dir) == [root], "mounted a second time over the first"
    assert "reusing the huge-page tmpfs" in second.log


def test_turned_off_stays_on_small_pages_and_says_why(
    checkpoint: Path, shm_dir: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(checkpoint), "--no-huge-tmpfs")
    assert mounts_below(shm_dir) == []
    s = _ready(d)
    assert (s.page_size, s.huge_page_bytes) == (4096, 0)
    status = d.status()
    [backing] = status.backings
    why, fix = backing.small_pages_reason, backing.small_pages_fix
    root = sets_root(shm_dir)
    assert (
        why == f"new sets in {root} get 4 KiB pages: the huge tmpfs is turned off (--no-huge-tmpfs)"
    )
    # The fix in full, where an operator reads it: status.
    assert "mount -t tmpfs -o huge=within_size,size=<bytes>,mode=0750" in fix and str(root) in fix
    assert "srv-engramd-shm.mount" in fix and f"(it is {shmem_enabled()})" in fix
    assert why in render(status) and fix in render(status)
    # One short log line: the same words as status, and where the fix is written.
    [line] = [line for line in d.log.splitlines() if "get 4 KiB pages" in line]
    said = line.split(" engramd: ", 1)[1]
    assert said == f"{why}; the fix: engramd status, docs/operations.md#fixing-4-kib-pages"
    assert len(said) < 200, said


def test_a_root_that_holds_sets_is_not_mounted_over(
    checkpoint: Path, shm_dir: Path, daemons: Any
) -> None:
    _needs_mount(shm_dir)
    old = daemons("--checkpoint", str(checkpoint), "--no-huge-tmpfs")
    _ready(old)
    assert old.stop(signal.SIGTERM) == 0

    d = daemons("--checkpoint", str(checkpoint))
    s = _ready(d)
    assert s.adopted and (s.page_size, s.huge_page_bytes) == (4096, 0)
    assert mounts_below(shm_dir) == [], "a mount would have hidden the adopted set"
    [backing] = d.status().backings
    assert "holds sets of an earlier daemon" in backing.small_pages_reason
    assert "drop them" in backing.small_pages_reason


@pytest.mark.parametrize(
    ("prefix", "why"),
    [
        (["setpriv", "--bounding-set=-sys_admin"], "CAP_SYS_ADMIN"),
        (["unshare", "--mount", "--propagation=slave"], "mount namespace"),
    ],
    ids=["no-cap-sys-admin", "private-mount-namespace"],
)
def test_no_mount_without_the_privilege_or_the_host_namespace(
    checkpoint: Path, shm_dir: Path, daemons: Any, prefix: list[str], why: str
) -> None:
    _needs_mount(shm_dir)
    d = daemons("--checkpoint", str(checkpoint), python=[*prefix, sys.executable])
    assert mounts_below(shm_dir) == []
    s = _ready(d)
    assert (s.page_size, s.huge_page_bytes) == (4096, 0)
    [backing] = d.status().backings
    assert why in backing.small_pages_reason, backing.small_pages_reason


def test_sets_in_the_mount_count_against_the_shm_folder(checkpoint: Path, daemons: Any) -> None:
    nbytes = plan_tables(checkpoint).nbytes
    with mounted_tmpfs(f"{nbytes // MiB + 4}m") as shm:
        _needs_mount(shm)
        d = daemons("--allow-root", str(checkpoint.parent), shm=shm)
        assert is_mount_point(sets_root(shm))
        # Another writer in the shm folder, outside the daemon's mount: the mount
        # alone could still hold the set, the shm folder's size cannot.
        (shm / "other-writer").write_bytes(b"\1" * (8 * MiB))
        plan = plan_tables(checkpoint)
        err = attach_error(d, pb.AttachRequest(set_id=plan.set_id, checkpoint=str(checkpoint)))
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason(err) == "capacity" and "free" in str(err.details()), err.details()
        (shm / "other-writer").unlink()
        assert (
            attach_error(d, pb.AttachRequest(set_id=plan.set_id, checkpoint=str(checkpoint)))
            is None
        )


def test_census_counts_huge_and_small_pages(shm_dir: Path) -> None:
    size = 5 * MiB + 12345  # two whole 2 MiB chunks and a tail
    small = shm_dir / "small"
    small.write_bytes(b"\3" * size)
    fd = os.open(small, os.O_RDONLY)
    try:
        c = census([fd])
    finally:
        os.close(fd)
    assert (c.nbytes, c.huge_bytes, c.page_size) == (size, 0, 4096)

    _needs_mount(shm_dir)
    root = shm_dir / "huge"
    root.mkdir()
    assert claim_huge_root(str(shm_dir), root, None, enabled=True) == ""
    try:
        (root / "f").write_bytes(b"\3" * size)
        fd = os.open(root / "f", os.O_RDONLY)
        try:
            c = census([fd])
        finally:
            os.close(fd)
        assert (c.nbytes, c.huge_bytes, c.page_size) == (size, 2 * HUGE, HUGE)
    finally:
        unmount_below(root)


def test_an_operators_huge_mount_over_the_root_is_used_with_its_own_size(
    checkpoint: Path, daemons: Any, workers: list[Worker]
) -> None:
    with mounted_tmpfs("8m") as shm:
        _needs_mount(shm)
        root = sets_root(shm)
        root.mkdir(mode=0o750)
        # Bigger than the shm folder under it: the operator's budget for the tables.
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "huge=within_size,size=64m,mode=0750", "tmpfs", root],
            check=True,
        )
        d = daemons("--checkpoint", str(checkpoint), shm=shm)
        s = _ready(d)
        assert s.huge_page_bytes == _expected_huge_bytes(checkpoint) > 0
        [backing] = d.status().backings
        assert backing.total_bytes == 64 * MiB and backing.small_pages_reason == ""
        assert mounts_below(shm) == [root, shm], "mounted over the operator's mount"
        w = Worker(checkpoint, d.socket, share="on")
        workers.append(w)
        assert w.hello["mode"] == "shared" and w.ask("lookups 0.2")["bad"] == 0
        assert w.exit() == 0


def test_a_writer_that_fills_the_shm_folder_after_the_check_fails_the_reservation(
    checkpoint: Path,
) -> None:
    plan = plan_tables(checkpoint)
    with mounted_tmpfs(f"{plan.nbytes // MiB + 4}m") as shm:
        _needs_mount(shm)
        backing = TmpfsBacking(str(shm), None, huge_tmpfs=True)
        backing.claim()
        try:
            assert backing.page_size == HUGE and backing.small_pages_reason == ""
            backing.check_capacity(backing.footprint([t.nbytes for t in plan.tensors]), "set")
            # Another writer takes the shm folder's space after the check: engramd's mount
            # would still hold the set, the shm folder it counts against no longer does.
            (shm / "other-writer").write_bytes(b"\1" * (8 * MiB))
            with pytest.raises(ShmCapacityError, match="ran out of space while reserving"):
                load_set(plan, backing, 2, LoadProgress(plan.nbytes))
            assert list(set_folders(shm)) == []
            (shm / "other-writer").unlink()
            manifest = load_set(plan, backing, 2, LoadProgress(plan.nbytes))
            pages = backing.page_census(manifest)
            assert pages is not None and pages.huge_bytes == _expected_huge_bytes(checkpoint)
        finally:
            unmount_below(sets_root(shm))


def test_a_mount_over_the_root_that_is_not_engramds_is_detached(
    checkpoint: Path, shm_dir: Path, daemons: Any, workers: list[Worker]
) -> None:
    _needs_mount(shm_dir)
    d = daemons("--checkpoint", str(checkpoint))
    [s] = d.status().sets
    assert d.stop() == 0
    root = sets_root(shm_dir)
    # Someone else's now, with altered bytes under the set's id.
    with open(root / s.set_id / "0000.bin", "r+b") as f:
        f.write(b"\xff" * 4096)
    os.chown(root, 65534, 65534)
    d.start()
    assert "a mount that is not engramd's; detached it" in d.log
    [s] = d.status().sets
    assert not s.adopted, "a set of the foreign mount was adopted"
    assert mounts_below(shm_dir) == [root] and root.stat().st_uid == os.geteuid()
    w = Worker(checkpoint, d.socket, share="on")
    workers.append(w)
    assert w.hello["digests"] == reference_digests(checkpoint)
    assert w.exit() == 0
