"""BlockingPool: calls on kept daemon threads, bounded, a stuck call blocking no other; idle
threads exit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import wait_until
from engramd.host import blocking
from engramd.host.blocking import BlockingPool


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"engramd-{name}"]


def test_calls_reuse_at_most_size_daemon_threads() -> None:
    async def main() -> list[int]:
        pool = BlockingPool("reuse", 3)
        results = await asyncio.gather(*(pool.run(lambda i=i: i * i) for i in range(50)))
        for _ in range(20):
            results.append(await pool.run(lambda: 1))
        return results

    assert asyncio.run(main()) == [i * i for i in range(50)] + [1] * 20
    kept = _threads("reuse")
    assert 1 <= len(kept) <= 3
    assert all(t.daemon for t in kept)


def test_an_error_reaches_the_caller_and_the_thread_serves_on() -> None:
    async def main() -> int:
        pool = BlockingPool("errors", 1)
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 // 0)
        return await pool.run(lambda: 7)

    assert asyncio.run(main()) == 7
    assert len(_threads("errors")) == 1


def test_a_stuck_call_holds_only_its_own_slot() -> None:
    stuck = threading.Event()
    release = threading.Event()

    def hang() -> None:
        stuck.set()
        release.wait(30)

    async def main() -> list[int]:
        pool = BlockingPool("stuck", 2)
        hung = asyncio.ensure_future(pool.run(hang))
        await asyncio.to_thread(stuck.wait, 30)
        # The one free slot serves every other call, one after another.
        done = [await pool.run(lambda i=i: i) for i in range(5)]
        release.set()
        await hung
        return done

    assert asyncio.run(main()) == list(range(5))
    assert len(_threads("stuck")) == 2


def test_idle_threads_exit_and_a_later_call_starts_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocking, "IDLE_S", 0.05)

    async def main() -> tuple[list[threading.Thread], list[threading.Thread]]:
        pool = BlockingPool("idle", 3)
        first = await asyncio.gather(*(pool.run(threading.current_thread) for _ in range(20)))
        await asyncio.to_thread(wait_until, lambda: not _threads("idle"), 5, "idle threads gone")
        later = await asyncio.gather(*(pool.run(threading.current_thread) for _ in range(20)))
        return first, later

    first, later = asyncio.run(main())
    # Each burst ran on at most `size` threads; the later one on threads started anew.
    assert 1 <= len(set(first)) <= 3 and 1 <= len(set(later)) <= 3
    assert not set(first) & set(later)


def test_calls_given_up_never_push_the_pool_past_its_size() -> None:
    entered = threading.Semaphore(0)
    release = threading.Event()
    ran: list[int] = []

    def hang(i: int) -> None:
        ran.append(i)
        entered.release()
        release.wait(30)

    async def main() -> int:
        pool = BlockingPool("given-up", 2)
        running = [asyncio.ensure_future(pool.run(hang, i)) for i in range(2)]
        for _ in range(2):
            await asyncio.to_thread(entered.acquire, True, 30)
        # Their callers hang up (a worker gone): the calls still run, and keep their slots.
        for task in running:
            task.cancel()
        queued = [asyncio.ensure_future(pool.run(hang, i)) for i in range(2, 6)]
        await asyncio.sleep(0)  # let them queue for a slot
        for task in queued:
            task.cancel()
        await asyncio.gather(*running, *queued, return_exceptions=True)
        release.set()
        # The slots come back once the running calls return; the queued ones never ran.
        return await pool.run(lambda: len(ran))

    assert asyncio.run(main()) == 2
    assert ran == [0, 1]
