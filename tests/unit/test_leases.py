"""LeaseBook in-process: grant, redeem on the fd channel's behalf, end, limits.

The sets are records over a backing that hands out a real pipe's descriptor;
no daemon, no socket.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from engramd.backings import Backing
from engramd.backings.handles import HandleKind
from engramd.sets import leases as leases_module
from engramd.sets.intents import AttachIntent, GpuRoute
from engramd.sets.leases import Caller, Lease, LeaseBook
from engramd.sets.loader import DEFAULT_PLACEMENT
from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import SetState, TableSet
from engramd_shared.errors import NotAllowed, SegmentNotVisible, TooManyLeases, UnknownSet
from engramd_shared.layout import Manifest
from engramd_shared.process import pid_namespace, start_ticks

SET_ID = "0123456789abcdef0123"
NOBODY = 65534


class PipeBacking:
    """A backing whose one file is a pipe's read end: descriptors the test can read back."""

    name = "fake"

    def __init__(self) -> None:
        self.handed: list[tuple[bool, int]] = []

    def descriptors(self, manifest: Manifest, writable: bool = False) -> list[tuple[str, int]]:
        read, write = os.pipe()
        os.write(write, b"set bytes")
        os.close(write)
        self.handed.append((writable, read))
        return [("tensor-0", read)]


@pytest.fixture
def backing() -> Iterator[PipeBacking]:
    made = PipeBacking()
    yield made
    for _, fd in made.handed:
        os.close(fd)


def book(backing: PipeBacking, published: bool = True, **limits: int) -> tuple[LeaseBook, TableSet]:
    """A lease book over one ready set in `backing`."""
    as_backing = cast(Backing, backing)
    sets = SetRegistry([as_backing], DEFAULT_PLACEMENT)
    ts = TableSet(
        set_id=SET_ID,
        checkpoint="/ckpt",
        selection="*",
        fingerprint="f",
        nbytes=9,
        ntensors=1,
        backing=as_backing,
        state=SetState.READY,
        published=published,
        manifest=cast(Manifest, object()),
    )
    ts.done.set()
    sets.add(ts)
    return LeaseBook(sets, **limits), ts


def me(**fields: Any) -> AttachIntent:
    """An attach from this test process, its pid claim true."""
    pid = os.getpid()
    claim = {"pid": pid, "pid_namespace": pid_namespace(), "pid_start": start_ticks(pid) or 0}
    return AttachIntent(set_id=SET_ID, **{**claim, **fields})


def caller(uid: int = 0, own_pid: int | None = None, groups: set[int] | None = None) -> Caller:
    """The fd channel's peer: this process (its own pid visible), unless told otherwise."""
    return Caller(
        pid=os.getpid(),
        uid=uid,
        own_pid=os.getpid() if own_pid is None else own_pid,
        groups=lambda: groups or {0},
    )


def redeem(leases: LeaseBook, lease: Lease, secret: str, who: Caller) -> list[tuple[str, int]]:
    return asyncio.run(leases.redeem(lease.lease_id, secret, who))


def test_a_grant_is_recorded_on_its_set_and_judged_by_the_claimed_pid(
    backing: PipeBacking,
) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(labels={"rank": "0"}, device="cuda:0"), HandleKind.SHM)
    assert leases.find(lease.lease_id) == (ts, lease)
    assert LeaseBook.count(ts) == 1 and lease.labels == {"rank": "0"}
    assert lease.pid_start == start_ticks(os.getpid()) and not lease.pid_verified
    assert not lease.collects and lease.uid is None and len(lease.fd_secret) == 32
    # A claim from another pid namespace is never judged by its pid.
    other = leases.add(ts, me(pid_namespace=1), HandleKind.SHM)
    assert other.pid_start is None
    # A first attach for descriptors collects them; a re-attach for them does not.
    assert leases.add(ts, me(), HandleKind.FD).collects
    assert not leases.add(ts, me(reattach=True), HandleKind.FD).collects


def test_no_lease_of_a_set_that_left_the_registry(backing: PipeBacking) -> None:
    leases, _ = book(backing)
    other = TableSet(SET_ID, "/ckpt", "*", "f", 9, 1, cast(Backing, backing))
    with pytest.raises(UnknownSet, match="dropped while the worker waited"):
        leases.add(other, me(), HandleKind.FD)


def test_redeem_hands_out_the_descriptors_once_and_binds_the_lease(
    backing: PipeBacking,
) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(), HandleKind.FD)
    secret = lease.fd_secret
    [(name, fd)] = redeem(leases, lease, secret, caller(uid=0))
    assert name == "tensor-0" and os.read(fd, 64) == b"set bytes"
    assert backing.handed == [(False, fd)]
    assert lease.uid == 0 and lease.pid_verified and lease.fd_secret == ""
    assert lease.pid_start == start_ticks(os.getpid())
    # The secret is spent: a second exchange with it gets nothing.
    with pytest.raises(NotAllowed, match="unused secret"):
        redeem(leases, lease, secret, caller(uid=0))
    assert len(backing.handed) == 1


def test_a_wrong_secret_spends_nothing_and_another_pid_ends_the_lease(
    backing: PipeBacking,
) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(), HandleKind.FD)
    secret = lease.fd_secret
    # Lease ids are no secret (status shows them): a wrong secret ends nothing.
    with pytest.raises(NotAllowed, match="unused secret"):
        redeem(leases, lease, "0" * 32, caller())
    with pytest.raises(NotAllowed, match="unused secret"):
        asyncio.run(leases.redeem("feedfacecafe", secret, caller()))
    assert lease.fd_secret == secret and not lease.ended.is_set()
    # The secret from another process: refused, and the lease can serve no one any more.
    with pytest.raises(NotAllowed, match=f"belongs to pid {os.getpid()}"):
        redeem(leases, lease, secret, caller(own_pid=os.getpid() + 1))
    assert backing.handed == [] and lease.uid is None
    assert lease.ended.is_set() and leases.find(lease.lease_id) is None
    with pytest.raises(NotAllowed, match="unused secret"):
        redeem(leases, lease, secret, caller())
    again = leases.add(ts, me(), HandleKind.FD)
    assert len(redeem(leases, again, again.fd_secret, caller())) == 1


def test_a_caller_whose_pid_is_not_visible_is_bound_by_the_secret_alone(
    backing: PipeBacking,
) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(pid=4242, pid_namespace=1), HandleKind.FD)
    hidden = Caller(pid=0, uid=0, own_pid=None, groups=lambda: {0})
    assert len(redeem(leases, lease, lease.fd_secret, hidden)) == 1
    assert lease.pid == 4242 and not lease.pid_verified and lease.uid == 0


def test_writable_descriptors_only_for_the_route_that_was_granted(backing: PipeBacking) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(), HandleKind.FD, GpuRoute.REGISTER_WRITABLE)
    redeem(leases, lease, lease.fd_secret, caller())
    assert [writable for writable, _ in backing.handed] == [True]


def test_a_workers_set_goes_only_to_a_uid_that_may_read_its_checkpoint(
    backing: PipeBacking, tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "a.safetensors").write_bytes(b"x")
    leases, ts = book(backing, published=False)
    readers = (str(private / "a.safetensors"),)
    lease = leases.add(ts, me(), HandleKind.FD, readers=readers)
    asked: list[bool] = []

    def groups() -> set[int]:
        asked.append(True)
        return {NOBODY}

    refused = Caller(os.getpid(), NOBODY, os.getpid(), groups)
    with pytest.raises(NotAllowed, match=f"uid {NOBODY} may not read"):
        redeem(leases, lease, lease.fd_secret, refused)
    assert asked and backing.handed == [] and lease.uid is None
    # The refused lease ended: it holds the set no longer, and counts for no one.
    assert lease.ended.is_set() and LeaseBook.count(ts) == 0
    # The secret went with the refused exchange: the worker attaches again.
    again = leases.add(ts, me(), HandleKind.FD, readers=readers)
    assert len(redeem(leases, again, again.fd_secret, caller(uid=0))) == 1


def test_a_set_no_longer_ready_is_not_handed_out(backing: PipeBacking) -> None:
    leases, ts = book(backing)
    lease = leases.add(ts, me(), HandleKind.FD)
    ts.state = SetState.FAILED
    with pytest.raises(SegmentNotVisible, match="no longer held"):
        redeem(leases, lease, lease.fd_secret, caller())
    assert backing.handed == [] and lease.ended.is_set() and LeaseBook.count(ts) == 0


def test_end_drain_and_end_all(backing: PipeBacking) -> None:
    leases, ts = book(backing)
    first, second, third = (leases.add(ts, me(), HandleKind.SHM) for _ in range(3))
    leases.end(first)
    assert leases.find(first.lease_id) is None and LeaseBook.count(ts) == 2
    leases.end(first)  # a stream that closes twice
    leases.drain()
    assert second.ended.is_set() and second.draining and third.draining
    assert LeaseBook.end_all(ts) == 2 and LeaseBook.count(ts) == 0


def test_max_leases_counts_granted_leases_only(backing: PipeBacking) -> None:
    leases, ts = book(backing, max_leases=1)
    collecting = leases.add(ts, me(), HandleKind.FD)
    # Not yet granted: an uncollected lease counts against no limit.
    held = leases.add(ts, me(), HandleKind.SHM)
    with pytest.raises(TooManyLeases, match="--max-leases"):
        leases.add(ts, me(), HandleKind.SHM)
    # Granted when collected: over the limit, it ends.
    with pytest.raises(TooManyLeases, match="--max-leases"):
        redeem(leases, collecting, collecting.fd_secret, caller())
    assert collecting.ended.is_set() and backing.handed == []
    leases.end(collecting)
    leases.end(held)
    again = leases.add(ts, me(), HandleKind.FD)
    assert len(redeem(leases, again, again.fd_secret, caller())) == 1


def test_leases_per_uid_is_each_users_share(backing: PipeBacking) -> None:
    leases, ts = book(backing, leases_per_uid=1)
    first, second = (leases.add(ts, me(), HandleKind.FD) for _ in range(2))
    redeem(leases, first, first.fd_secret, caller(uid=0))
    with pytest.raises(TooManyLeases, match="uid 0 hold 1 leases"):
        redeem(leases, second, second.fd_secret, caller(uid=0))
    assert second.ended.is_set()
    # Leases of unknown uid (path handles) share one uid's share between them.
    leases.add(ts, me(), HandleKind.SHM)
    with pytest.raises(TooManyLeases, match="cannot know"):
        leases.add(ts, me(), HandleKind.SHM)


def test_the_sweep_ends_leases_of_gone_processes_and_uncollected_ones(
    backing: PipeBacking, monkeypatch: pytest.MonkeyPatch
) -> None:
    leases, ts = book(backing)
    alive = leases.add(ts, me(), HandleKind.SHM)
    gone = leases.add(ts, me(), HandleKind.SHM)
    gone.pid_start = -1  # the process that claimed it is no longer the one with its pid
    late = leases.add(ts, me(), HandleKind.FD)
    monkeypatch.setattr(leases_module, "COLLECT_DEADLINE_S", 0.0)
    late.started = time.monotonic() - 1
    assert leases.sweep_dead() == 2
    assert gone.ended.is_set() and late.ended.is_set() and not alive.ended.is_set()
    assert [lease.lease_id for lease in LeaseBook.listed(ts)] == [alive.lease_id]


def test_a_lease_being_judged_counts_and_the_sweep_ends_it_in_time(
    backing: PipeBacking, monkeypatch: pytest.MonkeyPatch
) -> None:
    leases, ts = book(backing, published=False, max_leases=1)
    lease = leases.add(ts, me(), HandleKind.FD, readers=("/nowhere",))
    judging, release = threading.Event(), threading.Event()

    def hung(*args: object) -> bool:
        # The checkpoint's folder on a mount that hangs (released by the test).
        judging.set()
        assert release.wait(30), "the test never released the judgement"
        return True

    monkeypatch.setattr(leases_module, "may_read", hung)

    async def run() -> None:
        task = asyncio.create_task(leases.redeem(lease.lease_id, lease.fd_secret, caller()))
        assert await asyncio.to_thread(judging.wait, 30)
        # Its secret was presented: it counts against --max-leases while it is judged ...
        with pytest.raises(TooManyLeases, match="--max-leases"):
            leases.add(ts, me(), HandleKind.SHM)
        # ... and is not granted in time: the sweep ends it, and the judgement then grants nothing.
        monkeypatch.setattr(leases_module, "COLLECT_DEADLINE_S", 0.0)
        assert leases.sweep_dead() == 1
        release.set()
        with pytest.raises(NotAllowed, match="ended"):
            await task

    asyncio.run(run())
    assert backing.handed == [] and LeaseBook.count(ts) == 0 and lease.uid is None
