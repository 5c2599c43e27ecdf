"""Live tables: a worker that fell back because the daemon was down moves to the daemon's copy
at a step boundary (Tables.advance), at the same addresses, its private pages freed; a daemon
killed during a move leaves it on one whole copy."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Worker, wait_until
from engramd_client import attach
from engramd_client import share as share_module
from helpers import memfd_mappings

#: The issue's bound from a restarted daemon's readiness to a worker on its copy.
MOVE_BOUND_S = 2.0


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees a process that has warned about nothing yet."""
    monkeypatch.setattr(share_module, "_warned", set())
    monkeypatch.delenv("ENGRAMD_SHARE", raising=False)


def _private_files(pid: int) -> list[str]:
    """The private live copies (memfds) a process holds open."""
    named = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            named.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return [name for name in named if "engramd-private" in name]


def _rows_of(tables: Any, reference: Any) -> dict[str, bool]:
    return {
        name: bool(torch.equal(tables[name].view(torch.uint8), reference[name].view(torch.uint8)))
        for name in tables
    }


def test_a_worker_started_without_its_daemon_moves_to_its_copy(
    checkpoint: Path, sock_dir: Path, daemons: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The client library alone: private live tables at attach, the daemon's copy after one
    advance() once the daemon is ready, same addresses, the checkpoint's rows, the memfds gone."""
    caplog.set_level(logging.INFO, logger="engramd_client")
    socket = sock_dir / "d.sock"
    rows = {name: (1_000, 39_000) for name in attach(checkpoint, share=False)}
    # This process ran other tests first: what they left is not this worker's.
    gc.collect()
    mapped_before = set(memfd_mappings(os.getpid()))
    open_before = set(_private_files(os.getpid()))
    tables = attach(checkpoint, socket=str(socket), rows=rows)
    try:
        assert (tables.mode, tables.live) == ("private", True)
        before = {name: tables[name].data_ptr() for name in tables}
        heard: list[str] = []
        tables.until_shared(lambda: heard.append("shared"))
        tables.when_moved(lambda: heard.append("moved"))
        assert len(set(memfd_mappings(os.getpid())) - mapped_before) == len(tables)
        assert not tables.advance()  # nothing pending: nothing moves
        d = daemons("--checkpoint", str(checkpoint))
        ready = time.monotonic()
        while tables.mode != "shared" and time.monotonic() - ready < MOVE_BOUND_S:
            tables.advance()
            time.sleep(0.002)
        assert tables.mode == "shared", caplog.text
        assert heard == ["shared", "moved"]
        assert {name: tables[name].data_ptr() for name in tables} == before
        with attach(checkpoint, share=False, rows=rows) as reference:
            assert all(_rows_of(tables, reference).values())
        # The private copies are gone: no memfd mapped, none held open.
        assert set(memfd_mappings(os.getpid())) - mapped_before == set()
        # Closed off the step, in a thread of the tables' own.
        wait_until(
            lambda: not set(_private_files(os.getpid())) - open_before,
            10,
            "the private copies freed",
        )
        # The lease shows this worker, and the pages are the daemon's.
        (leased,) = d.status().sets
        assert [lease.pid for lease in leased.leases] == [os.getpid()]
        name = next(iter(tables))
        mapped = Path("/proc/self/maps").read_text()
        line = next(
            entry
            for entry in mapped.splitlines()
            if int(entry.split("-")[0], 16)
            <= tables[name].data_ptr()
            < int(entry.split()[0].split("-")[1], 16)
        )
        assert str(d.shm_dir) in line and line.split()[1] == "r--s", line
    finally:
        tables.close()
    said = [r.getMessage() for r in caplog.records if r.name == "engramd_client"]
    assert sum("Falling back to private tables" in m for m in said) == 1, said
    assert sum("moved from private copy to the daemon's copy" in m for m in said) == 1, said


def test_private_live_tables_closed_before_a_move_end_their_hooks(
    checkpoint: Path, sock_dir: Path
) -> None:
    """What waits for the move to shared (a fallback record's removal) happens at close too;
    the rejoin thread stops with the tables."""
    import threading

    others = set(threading.enumerate())
    tables = attach(checkpoint, socket=str(sock_dir / "d.sock"))
    heard: list[str] = []
    tables.until_shared(lambda: heard.append("shared"))
    (rejoin,) = [t for t in set(threading.enumerate()) - others if t.name == "engramd-rejoin"]
    tables.close()
    assert heard == ["shared"]
    assert not rejoin.is_alive()


def test_private_live_tables_dropped_unclosed_are_freed_and_stop_looking(
    checkpoint: Path, sock_dir: Path
) -> None:
    """Tables nobody keeps are collected as private tables always were: their addresses
    unmapped and their search for the daemon ended, not kept alive by that search."""
    import threading

    others = set(threading.enumerate())
    gc.collect()
    mapped_before = set(memfd_mappings(os.getpid()))
    tables = attach(checkpoint, socket=str(sock_dir / "d.sock"))
    assert tables.live
    (rejoin,) = [t for t in set(threading.enumerate()) - others if t.name == "engramd-rejoin"]
    ours = set(memfd_mappings(os.getpid())) - mapped_before
    assert len(ours) == len(tables)
    del tables
    gc.collect()
    # The thread wakes at least every rejoin_max_s, finds the tables gone and ends; what it
    # held to make a move (the addresses' regions) goes with it.
    rejoin.join(timeout=10)
    assert not rejoin.is_alive()
    gc.collect()
    assert not ours & set(memfd_mappings(os.getpid()))


def test_a_daemon_killed_after_handing_out_its_copy_leaves_one_whole_copy(
    checkpoint: Path, sock_dir: Path, daemons: Any, workers: list[Worker]
) -> None:
    """The move holds the daemon's descriptors before it maps anything: killed then, the
    daemon leaves the worker's next step on its whole copy, every row the checkpoint's."""
    w = Worker(checkpoint, sock_dir / "d.sock")
    workers.append(w)
    assert (w.hello["mode"], w.hello["live"]) == ("private", True)
    d = daemons("--checkpoint", str(checkpoint))

    def pending() -> bool:
        w.send("pending")
        answer = w.read()
        assert answer["mode"] == "private", answer
        return bool(answer["pending"])

    wait_until(pending, 10, "the daemon's copy in hand")
    d.stop(signal.SIGKILL)
    w.send("step")
    step = w.read()
    assert (step["moved"], step["mode"]) == (True, "shared")
    assert step["pointers"] == w.hello["pointers"]
    w.send("rows")
    assert all(w.read()["same"].values())
    assert memfd_mappings(w.proc.pid) == []
    assert w.exit() == 0


def test_daemons_killed_at_any_point_of_a_move_leave_whole_copies(
    checkpoint: Path, sock_dir: Path, daemons: Any, workers: list[Worker]
) -> None:
    """Daemons killed as soon as they are ready, while the worker looks for them, attaches or
    collects descriptors: after each, the worker's tables are one whole copy (every row the
    checkpoint's), private or the daemon's; a daemon that stays moves it."""
    w = Worker(checkpoint, sock_dir / "d.sock")
    workers.append(w)
    for _ in range(3):
        d = daemons("--checkpoint", str(checkpoint))
        d.stop(signal.SIGKILL)
        w.send("step")
        step = w.read()
        assert step["pointers"] == w.hello["pointers"]
        w.send("rows")
        assert all(w.read()["same"].values())
        if step["mode"] == "private":
            assert len(memfd_mappings(w.proc.pid)) == len(step["pointers"])
    daemons("--checkpoint", str(checkpoint))
    w.send(f"until_shared {MOVE_BOUND_S}")
    assert w.read()["mode"] == "shared"
    w.send("rows")
    assert all(w.read()["same"].values())
    assert memfd_mappings(w.proc.pid) == []
    # The private copies' descriptors went with them (off the step, in a thread).
    wait_until(lambda: not _private_files(w.proc.pid), 10, "the private copies freed")
    assert w.exit() == 0


def test_shared_live_tables_dropped_unclosed_are_unmapped(checkpoint: Path, daemons: Any) -> None:
    """Tables attached shared are live (their lease told to follow the set's generations),
    and tables nobody keeps are still collected: the lease's thread does not keep them."""
    d = daemons("--checkpoint", str(checkpoint))

    def mapped() -> int:
        return Path("/proc/self/maps").read_text().count(str(d.shm_dir))

    gc.collect()
    before = mapped()
    tables = attach(checkpoint, socket=str(d.socket), share=True)
    assert (tables.mode, tables.live) == ("shared", True)
    assert mapped() > before
    del tables
    gc.collect()
    assert mapped() == before


def test_a_move_that_arrives_after_the_ranks_voted_waits_for_the_next_vote(
    checkpoint: Path, sock_dir: Path, daemons: Any
) -> None:
    """An engine's ranks vote on the set they head for, then advance to it (StepGate): a move
    that became pending on one rank between its vote and its advance stays pending, or that
    rank alone would move at this step."""
    tables = attach(checkpoint, socket=str(sock_dir / "d.sock"))
    try:
        voted = tables.heading  # private, nothing pending: ""
        assert (tables.mode, voted) == ("private", "")
        d = daemons("--checkpoint", str(checkpoint))
        (ready,) = d.status().sets
        wait_until(lambda: tables.pending, 10, "the move to the daemon's copy pending")
        assert not tables.advance(to=voted)
        assert (tables.mode, tables.pending, tables.heading) == ("private", True, ready.set_id)
        assert tables.advance(to=tables.heading)
        assert (tables.mode, tables.set_id, tables.pending) == ("shared", ready.set_id, False)
    finally:
        tables.close()
