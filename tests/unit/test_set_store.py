"""The node's sets in-process: load, publish once, readiness, drop, a half-loaded set never served.

A SetKeeper over a real tmpfs backing in a fresh /dev/shm folder, driven on
an event loop of the test's own: no daemon, no socket.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engramd.backings import TmpfsBacking
from engramd.backings.handles import HandleKind
from engramd.config import DaemonConfig
from engramd.sets import store as store_module
from engramd.sets.intents import AttachIntent, Granted, Loaded, LoadIntent, Progress
from engramd.sets.keeper import SetKeeper
from engramd.sets.leases import LeaseBook
from engramd.sets.tableset import SetState, TableSet
from engramd.testing.synth import SynthSpec, synthesize
from engramd_shared.checkpoint import plan_tables
from engramd_shared.errors import Draining, DropRefused, UnknownSet
from engramd_shared.layout import Manifest, sets_root
from helpers import set_folders

T = TypeVar("T")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic Engram checkpoint of about 1 MB: loads in milliseconds."""
    return synthesize(tmp_path_factory.mktemp("ckpt") / "small", SynthSpec(rows=2000))


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The sets whose files were opened to the socket group (published), in order."""
    calls: list[str] = []
    real = TmpfsBacking.share_with_group

    def share(self: TmpfsBacking, manifest: Manifest) -> None:
        calls.append(manifest.set_id)
        real(self, manifest)

    monkeypatch.setattr(TmpfsBacking, "share_with_group", share)
    yield calls


@pytest.fixture
def paused(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Loads wait, on their thread, until the test sets the event."""
    release = threading.Event()
    real = store_module.load_set

    def waiting(*args: Any) -> Any:
        assert release.wait(60), "the test never released the load"
        return real(*args)

    monkeypatch.setattr(store_module, "load_set", waiting)
    yield release
    release.set()


def keeper(shm_dir: Path, **fields: Any) -> SetKeeper:
    """The sets of a daemon whose shm folder is `shm_dir` (no group, no mlock)."""
    config = DaemonConfig(shm_dir=str(shm_dir), socket_group="", mlock=False, **fields)
    return SetKeeper(config, [TmpfsBacking(str(shm_dir), None)])


def run(shm_dir: Path, test: Callable[[SetKeeper], Awaitable[T]], **fields: Any) -> T:
    """Run `test` on a fresh event loop over a fresh keeper, which is closed afterwards."""

    async def main() -> T:
        sets = keeper(shm_dir, **fields)
        await sets.store.adopt_existing(verify=False)
        try:
            return await test(sets)
        finally:
            await sets.close(drop=False, grace=10)

    return asyncio.run(main())


async def steps(gen: AsyncIterator[T]) -> list[T]:
    return [step async for step in gen]


def test_a_load_publishes_the_set_once_its_bytes_are_in(
    small: Path, shm_dir: Path, shared: list[str]
) -> None:
    set_id = plan_tables(small).set_id

    async def test(sets: SetKeeper) -> None:
        events = await steps(sets.load(LoadIntent(str(small))))
        assert all(isinstance(e, Progress) for e in events[:-1])
        loaded = events[-1]
        assert isinstance(loaded, Loaded)
        ts = loaded.ts
        assert ts.set_id == set_id and ts.state is SetState.READY and ts.published
        # Published once, after the load: the group's files are the complete set's.
        assert shared == [set_id]
        verified = await sets.verify(set_id)
        assert verified.ts is ts and verified.corrupted == [] and verified.fix == ""
        # A second load of the same checkpoint is the set already held.
        again = await steps(sets.load(LoadIntent(str(small))))
        assert again == [Loaded(ts)] and sets.store.held() == [ts]

    run(shm_dir, test)
    assert (sets_root(shm_dir) / set_id).is_dir()


def test_ready_once_every_configured_set_is(small: Path, shm_dir: Path) -> None:
    async def test(sets: SetKeeper) -> None:
        await sets.load_configured()
        assert not sets.store.ready
        [ts] = sets.store.configured
        assert ts.published
        assert await sets.store.settle(0.01, lambda: None)
        assert sets.store.ready and ts.state is SetState.READY

    run(shm_dir, test, checkpoints=[str(small)])


def test_a_configured_checkpoint_that_cannot_load_keeps_the_daemon_not_ready(
    small: Path, shm_dir: Path, tmp_path: Path
) -> None:
    async def test(sets: SetKeeper) -> None:
        await sets.load_configured()
        [ts] = sets.store.configured
        assert not await sets.store.settle(0.01, lambda: None)
        assert not sets.store.ready
        # The other configured set is served all the same.
        assert ts.state is SetState.READY and ts.published

    run(shm_dir, test, checkpoints=[str(tmp_path / "missing"), str(small)])


def test_settle_reports_progress_while_configured_sets_load(
    small: Path, shm_dir: Path, paused: threading.Event
) -> None:
    async def test(sets: SetKeeper) -> None:
        await sets.load_configured()
        waited: list[bool] = []

        def waiting() -> None:
            waited.append(sets.store.ready)
            if len(waited) == 3:
                paused.set()

        assert await sets.store.settle(0.01, waiting)
        assert len(waited) >= 3 and not any(waited)

    run(shm_dir, test, checkpoints=[str(small)])


def test_a_half_loaded_set_is_never_served(
    small: Path, shm_dir: Path, paused: threading.Event
) -> None:
    set_id = plan_tables(small).set_id

    async def test(sets: SetKeeper) -> None:
        await sets.load_configured()
        [ts] = sets.store.held()
        attach = sets.attach(AttachIntent(set_id=set_id, accept=(HandleKind.SHM,)))
        first = await anext(attach)
        # The worker hears of the load, and gets neither a lease nor a handle.
        assert first == Progress(0, ts.nbytes)
        assert ts.state is SetState.LOADING and LeaseBook.count(ts) == 0
        assert not (sets_root(shm_dir) / set_id).exists()
        paused.set()
        rest = await steps(attach)
        granted = rest[-1]
        assert isinstance(granted, Granted) and granted.ts is ts
        assert ts.state is SetState.READY and LeaseBook.count(ts) == 1
        assert (sets_root(shm_dir) / set_id).is_dir()
        sets.leases.end(granted.lease)

    run(shm_dir, test, checkpoints=[str(small)])


def test_a_load_that_stops_half_way_leaves_no_set_and_the_next_load_replaces_it(
    small: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, shared: list[str]
) -> None:
    set_id = plan_tables(small).set_id
    real = store_module.load_set

    def stopped(*args: Any) -> Any:
        args[3].cancel.set()  # the load's progress: as a shutdown cancels it
        return real(*args)

    monkeypatch.setattr(store_module, "load_set", stopped)

    async def test(sets: SetKeeper) -> TableSet:
        with pytest.raises(Draining, match="stopped while loading"):
            await steps(sets.load(LoadIntent(str(small))))
        [failed] = sets.store.held()
        assert failed.state is SetState.FAILED and not failed.published and shared == []
        assert list(set_folders(shm_dir)) == []
        # Not served by id: no operator published it.
        with pytest.raises(UnknownSet):
            await steps(sets.attach(AttachIntent(set_id=set_id)))
        monkeypatch.setattr(store_module, "load_set", real)
        events = await steps(sets.load(LoadIntent(str(small))))
        loaded = events[-1]
        assert isinstance(loaded, Loaded) and loaded.ts is not failed
        assert sets.store.held() == [loaded.ts] and shared == [set_id]
        return loaded.ts

    assert run(shm_dir, test).state is SetState.READY


def test_drop_refuses_a_loading_or_leased_set_unless_forced(
    small: Path, shm_dir: Path, paused: threading.Event
) -> None:
    set_id = plan_tables(small).set_id

    async def test(sets: SetKeeper) -> None:
        load = asyncio.ensure_future(steps(sets.load(LoadIntent(str(small)))))
        while not sets.store.held():
            await asyncio.sleep(0)
        with pytest.raises(DropRefused, match="still loading"):
            await sets.drop(set_id, force=False)
        paused.set()
        [loaded] = (await load)[-1:]
        assert isinstance(loaded, Loaded)
        granted = (await steps(sets.attach(AttachIntent(set_id=set_id))))[-1]
        assert isinstance(granted, Granted)
        with pytest.raises(DropRefused, match="1 leases"):
            await sets.drop(set_id, force=False)
        assert sets.store.held() == [loaded.ts]
        assert await sets.drop(set_id, force=True) == (loaded.ts.nbytes, 1)
        assert granted.lease.ended.is_set() and sets.store.held() == []
        assert not (sets_root(shm_dir) / set_id).exists()
        with pytest.raises(UnknownSet):
            await sets.drop(set_id, force=True)

    run(shm_dir, test)
