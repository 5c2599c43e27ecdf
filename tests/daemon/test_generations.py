"""Generations: the operator loads a new revision of a set's tables (same names and shapes,
other bytes) and running workers move to it at one step boundary (Tables.advance), at the
same addresses, no step reading a mix; the old copy goes once its last lease moved; other
shapes are refused with the restart they need; kills during a move leave whole generations."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from conftest import Worker
from engramd.testing.synth import SynthSpec, seeds_held, synthesize
from engramd_client import attach
from engramd_shared.layout import sets_root
from engramd_shared.pb import engramd_pb2 as pb
from helpers import engramd, load_set, set_folders, wait_until

#: The session checkpoint's shape (conftest.checkpoint): a new revision keeps it.
ROWS = 40_000


@pytest.fixture
def revised(tmp_path: Path, checkpoint: Path) -> Path:
    """A copy of the session checkpoint (seed 0) that a test rewrites in place."""
    folder = tmp_path / "revised"
    shutil.copytree(checkpoint, folder)
    return folder


def _sets(d: Any) -> dict[str, pb.SetInfo]:
    return {s.set_id: s for s in d.status().sets}


@pytest.mark.parametrize("backing", ["tmpfs", "disk"])
def test_a_new_revision_in_place_reaches_a_running_worker_at_one_step(
    revised: Path, daemons: Any, request: pytest.FixtureRequest, backing: str
) -> None:
    """Files rewritten in place and loaded again: the worker's tables move to generation 2
    at one advance(), same addresses, every row the new revision's, no step a mix; the old
    copy is dropped once the lease moved (its files gone, on the disk backing from the
    disk folder); status shows the generations."""
    # Only the disk case asks for the disk folder (its fixture skips on a tmpfs).
    disk: Path | None = request.getfixturevalue("disk") if backing == "disk" else None
    on = ("--backing", "disk", "--disk-dir", str(disk)) if disk else ()
    d = daemons("--checkpoint", str(revised), *on)
    held_in = disk or d.shm_dir
    tables = attach(revised, socket=str(d.socket), share=True)
    try:
        assert (tables.mode, tables.live) == ("shared", True)
        first = tables.set_id
        before = {name: tables[name].data_ptr() for name in tables}
        assert seeds_held(tables) == {0}
        synthesize(revised, SynthSpec(rows=ROWS, seed=1))
        ready = load_set(d, revised)
        assert ready.generation == 2 and ready.set_id != first
        held = _sets(d)
        assert held[first].replaced_by == ready.set_id
        assert [lease.pid for lease in held[first].leases] == [os.getpid()]
        # Until the move is in hand and the step comes, every step reads generation 1 whole.
        while not tables.pending:
            tables.advance()
            assert seeds_held(tables) == {0}
            time.sleep(0.002)  # an engine's step
        assert tables.advance()
        assert seeds_held(tables) == {1}
        assert tables.set_id == ready.set_id
        assert {name: tables[name].data_ptr() for name in tables} == before
        with attach(revised, share=False) as reference:
            for name in tables:
                assert torch.equal(
                    tables[name].view(torch.uint8), reference[name].view(torch.uint8)
                )
        # The old copy goes once its last lease moved: memory back, one copy left.
        wait_until(lambda: first not in _sets(d), 30, "the old generation dropped")
        (current,) = d.status().sets
        assert current.generation == 2 and not current.replaced_by
        assert current.backing == backing
        assert [lease.pid for lease in current.leases] == [os.getpid()]
        assert set_folders(held_in) == [sets_root(held_in) / ready.set_id]
    finally:
        tables.close()
    assert "Traceback" not in d.log


def test_a_revision_of_other_shapes_is_refused_with_the_restart_it_needs(
    revised: Path, daemons: Any
) -> None:
    d = daemons("--checkpoint", str(revised))
    tables = attach(revised, socket=str(d.socket), share=True)
    try:
        first = tables.set_id
        synthesize(revised, SynthSpec(rows=ROWS + 512, seed=1))
        with pytest.raises(grpc.RpcError) as info:
            load_set(d, revised)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        said = str(info.value.details())
        assert f"cannot replace set {first}" in said and "a restart is needed" in said, said
        assert f"engramd drop {first}" in said and "captured CUDA graphs" in said, said
        # Nothing was loaded, nothing moves: the worker keeps generation 1.
        assert list(_sets(d)) == [first]
        assert not tables.advance() and tables.set_id == first
    finally:
        tables.close()


def test_another_folder_replaces_a_set_when_named_and_a_killed_worker_leaves_one_copy(
    checkpoint: Path, tmp_path: Path, daemons: Any, workers: list[Worker]
) -> None:
    """`--replaces` names the set another folder's revision replaces. A worker killed with
    its move in hand ends both its leases; another worker moves, every step whole; the old
    generation goes once the last lease moved."""
    other = synthesize(tmp_path / "other", SynthSpec(rows=ROWS, seed=1))
    d = daemons("--checkpoint", str(checkpoint))
    (first,) = _sets(d)
    mover = Worker(first, d.socket, share="on")
    killed = Worker(first, d.socket, share="on")
    workers += [mover, killed]
    assert mover.hello["live"] and killed.hello["live"]
    with pytest.raises(grpc.RpcError) as info:
        load_set(d, other, replaces="0" * 20)
    assert "no set 00000000000000000000 to replace" in str(info.value.details())
    # Another folder, unnamed: a set of its own beside the first, which nothing replaces.
    alone = load_set(d, other)
    assert alone.generation == 1 and not _sets(d)[first].replaced_by
    loaded = engramd("load", str(other), "--replaces", first, "--socket", str(d.socket))
    assert loaded.returncode == 0, loaded.stderr
    assert f"set {alone.set_id} ready" in loaded.stdout, loaded.stdout
    assert "generation 2: running engines move to it at their next step" in loaded.stdout
    ready = _sets(d)[alone.set_id]
    assert ready.generation == 2 and _sets(d)[first].replaced_by == ready.set_id
    wait_until(lambda: killed.ask("pending")["pending"], 30, "the killed worker's move in hand")
    killed.kill()
    moved = mover.ask(f"follow {ready.set_id} 60")
    assert moved["set_id"] == ready.set_id and moved["mixed"] == 0, moved
    assert moved["seeds"] == ["1"] and moved["pointers"] == mover.hello["pointers"]
    wait_until(lambda: first not in _sets(d), 30, "the old generation dropped")
    leases = _sets(d)[ready.set_id].leases
    assert [lease.pid for lease in leases] == [mover.proc.pid]
    assert mover.exit() == 0


def test_a_daemon_killed_during_a_move_leaves_every_worker_on_one_whole_generation(
    revised: Path, daemons: Any, workers: list[Worker]
) -> None:
    """The move in hand holds its descriptors: the daemon killed before the step, the step
    still maps the new generation whole, and a restarted daemon gives the lease back. A
    worker stopped through the load and the kill steps on the old generation whole until
    the operator's load of the new revision again (the restarted daemon adopted both)
    moves it; the old generation then goes."""
    d = daemons("--checkpoint", str(revised))
    tables = attach(revised, socket=str(d.socket), share=True)
    first = tables.set_id
    stopped = Worker(revised, d.socket, share="on")
    workers.append(stopped)
    try:
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        synthesize(revised, SynthSpec(rows=ROWS, seed=1))
        ready = load_set(d, revised)
        wait_until(lambda: tables.pending, 30, "the move in hand")
        d.stop(signal.SIGKILL)
        assert seeds_held(tables) == {0}
        assert tables.advance()
        assert seeds_held(tables) == {1} and tables.set_id == ready.set_id
        again = daemons("--checkpoint", str(revised))
        os.kill(stopped.proc.pid, signal.SIGCONT)
        wait_until(
            lambda: any(s.leases for s in again.status().sets if s.set_id == ready.set_id),
            30,
            "the lease re-established on the new generation",
        )
        assert seeds_held(tables) == {1}
        assert load_set(again, revised).set_id == ready.set_id
        moved = stopped.ask(f"follow {ready.set_id} 60")
        assert moved["set_id"] == ready.set_id and moved["mixed"] == 0, moved
        assert moved["seeds"] == ["1"], moved
        wait_until(lambda: first not in _sets(again), 30, "the old generation dropped")
        assert stopped.exit() == 0
    finally:
        tables.close()
