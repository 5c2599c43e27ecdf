"""A fallen-back worker looks for its daemon, cheaply and with backoff, until it can move.

A worker whose daemon was unreachable when it attached holds private live
tables (Tables.private_live). This thread tries the socket (a plain
connect: microseconds, no gRPC) with backoff from `reconnect_min_s` to
`rejoin_max_s`; once something listens it attaches the set, collects its
descriptors and offers the tables a whole move (Tables.offer), which the
engine makes at its next step boundary (Tables.advance). A daemon that
answers but cannot serve is asked again less often. Nothing here touches
the tables' pages: a daemon that stops during a try leaves them as they
were.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from engramd_client.tables import Move, Tables
from engramd_shared.channel import probe_socket
from engramd_shared.config import ClientConfig
from engramd_shared.errors import DaemonUnavailable, ShareError

log = logging.getLogger("engramd_client")

#: Longest pause between tries where the daemon answered but could not serve: it will not
#: change its mind soon, and each try attaches the set.
REFUSED_MAX_S = 30.0


def start_rejoin(tables: Tables, config: ClientConfig, attempt: Callable[[], Move]) -> None:
    """Look for the daemon in a thread until `attempt` gives a move `tables` accept.

    `tables.close()` stops the thread, and so do tables dropped unclosed: the thread holds
    them weakly, so tables nobody keeps are collected (their addresses unmapped) as private
    tables always were, not kept alive by their own search for the daemon.
    """
    stop = threading.Event()
    thread = threading.Thread(
        target=_run,
        args=(weakref.ref(tables), config, attempt, stop),
        name="engramd-rejoin",
        daemon=True,
    )

    def stop_rejoin() -> None:
        stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout=config.reply_timeout_s + 5)

    tables.stop_rejoin = stop_rejoin
    thread.start()


def _run(
    held: weakref.ref[Tables],
    config: ClientConfig,
    attempt: Callable[[], Move],
    stop: threading.Event,
) -> None:
    delay = config.reconnect_min_s
    told = ""
    while not stop.wait(delay):
        if held() is None:
            return
        try:
            probe_socket(config.socket, config.connect_timeout_s)
            move = attempt()
        except DaemonUnavailable:
            delay = min(delay * 2, config.rejoin_max_s)
            continue
        except ShareError as e:
            if str(e) != told:
                told = str(e)
                log.info("engramd answers but cannot serve this worker's tables yet: %s", e)
            delay = min(max(delay, config.rejoin_max_s) * 2, REFUSED_MAX_S)
            continue
        except Exception as e:
            # A bug or the machine's limits (descriptors, addresses): say it, keep trying.
            if str(e) != told:
                told = str(e)
                log.warning("engramd: moving to the daemon's copy failed: %s", e, exc_info=True)
            delay = min(max(delay, config.rejoin_max_s) * 2, REFUSED_MAX_S)
            continue
        tables = held()
        if stop.is_set() or tables is None:
            move.discard()
            return
        why = tables.offer(move)
        if why is None:
            log.debug("engramd: the daemon's copy of set %s waits for the next step", move.set_id)
            return
        log.warning(
            "engramd holds set %s, but this worker cannot map it at its tables' addresses (%s): "
            "it keeps its private tables until it restarts",
            move.set_id,
            why,
        )
        return
