"""Blocking calls off the event loop, on threads that never hold up the daemon's exit.

asyncio's default executor (and every ThreadPoolExecutor) is joined when
the interpreter exits, so one read stuck on a hung NFS or FUSE mount keeps
a stopped daemon alive forever. A `BlockingPool` runs each call on a daemon
thread instead: shutdown waits for it only as long as its grace period.
Each pool is bounded, and the daemon keeps one per kind of work, so reads
of workers' checkpoints cannot starve its own file operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Seconds a pool's thread waits for another call before it exits: kept through a
#: storm of calls, gone once the daemon is quiet again.
IDLE_S = 2.0


class BlockingPool:
    """Runs blocking calls on daemon threads, at most `size` at once.

    Threads are started as calls need them and kept while calls keep coming
    (IDLE_S): starting one blocks the event loop until the new thread first
    runs, which on a busy machine is a wait for a core, and a storm of
    attaches would pay it for every read.
    """

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._slots: asyncio.Semaphore | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Threads waiting for a job that none was promised yet.
        self._idle = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a daemon thread; waits for a free slot first.

        A call given up (its task cancelled) before its thread took it up is
        dropped; one given up while it runs keeps its slot until it returns,
        so callers that hang up never push the pool past its size.
        """
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        slots = self._slots
        await slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            slots.release()
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def job() -> None:
            result: T | None = None
            error: BaseException | None = None
            # Read from this thread: at worst a call given up this instant still runs.
            if not done.cancelled():
                try:
                    result = fn(*args)
                except BaseException as e:
                    error = e
            # Idle before the result is seen: the next call takes this thread.
            with self._lock:
                self._idle += 1
            # A closed loop: the daemon stopped without waiting for this result.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        try:
            self._submit(job)
        except BaseException:
            slots.release()
            raise
        return await done

    def _submit(self, job: Callable[[], None]) -> None:
        # Each job gets an idle thread promised to it, or a new one: it never
        # waits behind another job, and the slots keep the threads to `size`
        # unless callers gave up on calls still running (a hung read).
        with self._lock:
            self._jobs.put(job)
            start = not self._idle
            if not start:
                self._idle -= 1
        if start:
            name = f"engramd-{self._name}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_S)
            except queue.Empty:
                # Under the lock that queues jobs: an idle thread no job was
                # promised to may go; one a job was just queued for stays.
                with self._lock:
                    if self._jobs.empty() and self._idle:
                        self._idle -= 1
                        return
                continue
            job()


def cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset limits it)."""
    return max(len(os.sched_getaffinity(0)), 1)


def map_on_threads(fn: Callable[[T], R], items: list[T], threads: int, name: str) -> list[R]:
    """[fn(item) for item in items] on up to `threads` daemon threads, in order.

    The first exception stops the handing out of further items and is raised
    once the running calls return.
    """
    results: list[R | None] = [None] * len(items)
    errors: list[BaseException] = []
    pending = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = None if errors else next(pending, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:
                with lock:
                    errors.append(e)
                return

    workers = [
        threading.Thread(target=work, name=f"engramd-{name}", daemon=True)
        for _ in range(max(1, min(threads, len(items))))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
