"""The disk backing (`--backing disk`): a set on a local disk folder, written once, read-only to
everyone, the page cache's to evict, adopted across restarts without reading the checkpoint."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from engine_harness import drop_cache

from conftest import Worker
from engramd.cli.status_view import render
from engramd.testing.pagecache import cached, evict
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.layout import MANIFEST_NAME, sets_root
from helpers import memory_cgroup_folder, reference_digests, set_folders


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128 MiB of tables: the cgroup test's reader has less room than that."""
    return synthesize(tmp_path_factory.mktemp("disk-ckpt") / "engram", SynthSpec(rows=254_250))


def _serve(daemons: Any, disk: Path, checkpoint: Path, *args: str) -> Any:
    # These tests read the set cold after evicting it: no warm-up reads it back meanwhile
    # (test_disk_warming.py tests the warm-up).
    return daemons(
        *("--backing", "disk", "--disk-dir", str(disk), "--checkpoint", str(checkpoint)),
        "--no-warm-page-cache",
        *args,
    )


def test_a_disk_set_is_read_only_never_locked_and_adopted_without_reading_the_checkpoint(
    tables: Path, disk: Path, daemons: Any, workers: list[Worker]
) -> None:
    expected = reference_digests(tables)
    d = _serve(daemons, disk, tables)
    [s] = d.status().sets
    assert s.backing == "disk" and s.state == "ready" and not s.locked
    assert s.HasField("resident_bytes") and 0 < s.resident_bytes <= s.bytes
    row = next(line for line in render(d.status()).splitlines() if s.set_id in line)
    assert "% (off)" in row, row  # the CACHED column
    [folder] = set_folders(disk)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert stat.S_IMODE(sets_root(disk).stat().st_mode) == 0o750
    for path in folder.iterdir():
        # Written once by the daemon; the set the operator configured is published: the
        # group reads it, nobody writes it.
        assert stat.S_IMODE(path.stat().st_mode) == 0o440, path
        assert path.stat().st_uid == os.geteuid()
    w = Worker(tables, d.socket, share="on")
    workers.append(w)
    assert w.hello["mode"] == "shared" and w.hello["digests"] == expected
    w.exit()
    d.stop()

    # The next daemon finds the set whole and takes it over: the checkpoint's tables are
    # not read again (only its headers and the fingerprint's samples).
    drop_cache(tables)
    again = _serve(daemons, disk, tables)
    [s] = again.status().sets
    assert s.adopted and s.state == "ready" and s.source == "adopted"
    assert again.log.count("loading set") == 1  # the first daemon's (one log)
    assert cached(tables) < s.bytes / 20, cached(tables)
    evict(disk)
    assert again.status().sets[0].resident_bytes < s.bytes / 20
    w = Worker(tables, again.socket, share="on")
    workers.append(w)
    assert w.hello["digests"] == expected
    # The worker's reads brought the set back into the page cache, and status says so.
    assert again.status().sets[0].resident_bytes >= s.bytes * 0.9


def test_a_file_cut_short_is_refused_at_the_next_attach_and_not_adopted(
    tables: Path, disk: Path, daemons: Any, workers: list[Worker]
) -> None:
    d = _serve(daemons, disk, tables)
    [folder] = set_folders(disk)
    victim = sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME)[0]
    os.chmod(victim, 0o600)  # root needs no mode to write; the daemon's user would
    os.truncate(victim, victim.stat().st_size // 2)
    w = Worker(tables, d.socket, share="on")
    workers.append(w)
    assert w.hello["error"] == "FailedVerification", w.hello
    assert f"{victim.name} is {victim.stat().st_size} bytes" in w.hello["message"]
    [s] = d.status().sets
    assert s.state == "failed-verification" and "bytes, manifest says at least" in s.error
    assert "load it again" in s.error
    # A worker that may fall back maps its own copy, with the checkpoint's bytes.
    w = Worker(tables, d.socket)
    workers.append(w)
    assert w.hello["mode"] == "private" and w.hello["digests"] == reference_digests(tables)
    w.exit()
    d.stop()
    # The next daemon does not take the cut file over: it loads the set anew.
    again = _serve(daemons, disk, tables)
    [s] = again.status().sets
    assert not s.adopted and s.state == "ready"
    assert "not a complete set of engramd's own" in again.log


def test_a_file_written_after_its_manifest_is_not_adopted(
    tables: Path, disk: Path, daemons: Any
) -> None:
    d = _serve(daemons, disk, tables)
    d.stop()
    [folder] = set_folders(disk)
    victim = sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME)[0]
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as f:
        f.write(b"\xff" * 64)  # root's write: same size, a later mtime
    again = _serve(daemons, disk, tables)
    [s] = again.status().sets
    assert not s.adopted
    assert "was modified after its manifest was written" in again.log


def test_a_worker_under_a_memory_cgroup_smaller_than_the_set_reads_every_byte(
    tables: Path, disk: Path, daemons: Any, workers: list[Worker]
) -> None:
    expected = reference_digests(tables)
    d = _serve(daemons, disk, tables)
    [s] = d.status().sets
    # Out of the page cache (no process maps them): each is read again at a worker's fault.
    evict(disk)
    assert d.status().sets[0].resident_bytes < s.bytes / 20
    with memory_cgroup_folder(1 << 40) as (group, limit_file):
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        w = Worker(tables, d.socket, share="on", prefix=["sh", "-c", join, "sh"], untouched=True)
        workers.append(w)
        try:
            assert w.hello["mode"] == "shared"
            # Once the worker is up: room for it and a quarter of the set, no more.
            usage = "memory.current" if limit_file == "memory.max" else "memory.usage_in_bytes"
            limit = int((group / usage).read_text()) + s.bytes // 4
            (group / limit_file).write_text(str(limit))
            # Every page faulted in from the disk through the worker's mapping, charged to
            # a cgroup that holds a quarter of them: the kernel evicts as the worker reads.
            assert w.ask("digest")["digests"] == expected
            assert w.proc.poll() is None
            stayed = cached(disk)
            assert stayed < s.bytes * 0.6, f"{stayed} of {s.bytes} bytes stayed cached"
            assert stayed - 4096 <= d.status().sets[0].resident_bytes <= stayed  # but the manifest
            w.exit()
        finally:
            w.kill()


@pytest.mark.parametrize(
    ("where", "mode"),
    [("parent", 0o775), ("parent", 0o777), ("itself", 0o775)],
)
def test_a_disk_folder_others_may_replace_is_refused_with_the_fix(
    tables: Path, disk: Path, daemons: Any, where: str, mode: int
) -> None:
    """--disk-dir in a folder its group (or every user) may write, or group-writable itself,
    without a sticky bit: a member could rename the daemon's folder away and put another in
    its place, so the daemon refuses to start and names the folder and the fix. Sticky, the
    same folder is taken."""
    shared = disk / "shared"
    shared.mkdir()
    folder = shared / "tables"
    folder.mkdir()
    for p in (shared, folder):
        p.chmod(0o755)
    loose = shared if where == "parent" else folder
    loose.chmod(mode)
    d = daemons(
        *("--backing", "disk", "--disk-dir", str(folder), "--checkpoint", str(tables)), wait="no"
    )
    assert d.proc is not None
    assert d.proc.wait(timeout=60) != 0, d.log
    who = "every user" if mode & 0o002 else "the members of its group"
    assert f"{loose} may be written by {who}" in d.log, d.log
    assert f"chmod go-w {loose}" in d.log
    assert not sets_root(folder).exists()
    loose.chmod(mode | 0o1000)
    ready = daemons(*("--backing", "disk", "--disk-dir", str(folder), "--checkpoint", str(tables)))
    assert [s.state for s in ready.status().sets] == ["ready"]
