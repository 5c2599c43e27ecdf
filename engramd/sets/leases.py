"""Leases: a worker's hold on a set while its Attach stream is open; their limits and counters.

Every lease lives on its set (`TableSet.leases`); this room alone writes
them: it adds them, redeems their fd-channel secret for the caller the kernel
names, charges them to uids, tells their workers when their copy failed
verification, and ends them (their stream closed, their process gone, the set
dropped, the daemon stopping).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engramd.backings.handles import HandleKind
from engramd.sets.intents import AttachIntent, GpuRoute
from engramd.sets.policy import may_read
from engramd.sets.registry import SetRegistry
from engramd.sets.tableset import COMPLETE, SetKey, SetState, TableSet, set_key
from engramd_shared.beneath import Opened
from engramd_shared.errors import (
    FailedVerification,
    NotAllowed,
    SegmentNotVisible,
    TooManyLeases,
    UnknownSet,
)
from engramd_shared.layout import ManifestError, NotOwned
from engramd_shared.process import pid_namespace, start_ticks

log = logging.getLogger("engramd")

#: Seconds a first lease of descriptors (HandleKind.FD, not a re-attach) has to
#: collect them on the fd channel, where its uid becomes known; until then it is
#: charged to no uid and counts against no limit.
COLLECT_DEADLINE_S = 10.0
#: Handle kinds whose workers collect descriptors on the fd channel.
ON_FD_CHANNEL = frozenset({HandleKind.FD, HandleKind.CUMEM})

#: Leases listed per set in a status reply (all are counted): a reply stays far
#: below gRPC's 4 MiB limit whatever the workers send.
STATUS_LEASES = 64

_PID_NAMESPACE = pid_namespace()


class Stats:
    """Counters the event loop updates and the metrics thread reads, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attaches: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._served = 0

    def received(self, by_source: dict[str, int]) -> None:
        """Count the bytes a finished load took from each source ("files", a peer, a store)."""
        with self._lock:
            self._received.update(by_source)

    def served(self, nbytes: int) -> None:
        """Count bytes granted to peers (each granted window or piece is read by the peer)."""
        with self._lock:
            self._served += nbytes

    def moved(self) -> tuple[dict[str, int], int]:
        """(bytes received by source, bytes served to peers), copied."""
        with self._lock:
            return dict(self._received), self._served

    def attach(self, ok: bool) -> None:
        """Count an attach answered with the set ("ok") or an error."""
        with self._lock:
            self._attaches["ok" if ok else "error"] += 1

    def fallback(self, cause: str) -> None:
        """Count a worker's fallback to private tables (a known cause)."""
        with self._lock:
            self._fallbacks[cause] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """(attaches by result, fallbacks by cause), copied."""
        with self._lock:
            return {"ok": 0, "error": 0, **self._attaches}, dict(self._fallbacks)


@dataclass
class Lease:
    """One worker attached to one set, for as long as its Attach stream is open."""

    lease_id: str
    set_id: str
    #: The name of the backing of the set the lease holds.
    backing: str
    #: The NUMA node of the copy the lease holds (--numa per-node), else None.
    node: int | None
    pid: int
    labels: dict[str, str]
    #: When the process `pid` started (clock ticks after boot), where the worker's
    #: claim (its pid namespace and start time) matched a process here, or the fd
    #: channel saw it; None: the sweep never judges this lease by its pid (the
    #: stream still ends it). A matching claim ends, at worst, the claimer's lease.
    pid_start: int | None
    #: The worker maps an earlier copy of the set than the one the daemon holds.
    stale: bool = False
    #: How the worker maps the set.
    kind: HandleKind = HandleKind.SHM
    #: The CUDA device the worker registers the set for ("cuda:N"), or "".
    device: str = ""
    #: How the worker reads the set on that device (engramd.v1.GpuRoute).
    gpu_route: GpuRoute = GpuRoute.UNSPECIFIED
    #: One-time secret for the fd channel; "" once used.
    fd_secret: str = field(default_factory=lambda: secrets.token_hex(16))
    #: The worker's uid, once the kernel told it (SO_PEERCRED on the fd channel); None:
    #: unknown (the gRPC socket has no peer credentials).
    uid: int | None = None
    #: `pid` is the fd channel's peer as the kernel gave it, not the request's claim.
    pid_verified: bool = False
    #: A first attach for descriptors: it collects them within COLLECT_DEADLINE_S or
    #: ends, and is granted (counted against --max-leases) and charged to its uid
    #: then. Any other lease is charged to "uid unknown" until its worker comes to
    #: the fd channel.
    collects: bool = False
    started: float = field(default_factory=time.monotonic)
    #: The checkpoint files the worker attached with (the set's own, or proven to hold
    #: its bytes): a set no operator published goes to a uid that may read them. Held
    #: open where the daemon opened them beneath a root (judged by descriptor), else paths.
    readers: tuple[str | Opened, ...] = ()
    #: Set when the daemon ends the lease (sweep, drop or shutdown).
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: The lease was ended because the daemon is stopping.
    draining: bool = False
    #: Set when the copy the lease maps failed verification: its worker is told it is stale.
    told_stale: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def set_key(self) -> SetKey:
        """The key of the set copy this lease maps."""
        return set_key(self.set_id, self.backing, self.node)


@dataclass(frozen=True)
class Caller:
    """The fd channel's peer, as the kernel named it (SO_PEERCRED, /proc)."""

    #: Its pid in the daemon's pid namespace.
    pid: int
    uid: int
    #: Its pid in its own namespace (the last NSpid); None where the daemon cannot see it.
    own_pid: int | None
    #: Its groups; read only when a set no operator published asks for them.
    groups: Callable[[], set[int]]
    #: Where the daemon saw those groups (/proc, or what connecting proved), for a refusal.
    groups_from: str = "its groups"


class LeaseBook:
    """The leases of the sets in a registry, within --max-leases and --leases-per-uid."""

    def __init__(self, sets: SetRegistry, max_leases: int = 0, leases_per_uid: int = 0) -> None:
        self._sets = sets
        self._max_leases = max_leases
        self._leases_per_uid = leases_per_uid
        #: Attaches served and refused, fallbacks reported (metrics).
        self.stats = Stats()

    def add(
        self,
        ts: TableSet,
        intent: AttachIntent,
        kind: HandleKind,
        gpu_route: GpuRoute = GpuRoute.UNSPECIFIED,
        readers: tuple[str | Opened, ...] = (),
    ) -> Lease:
        """Record a worker attached to a ready set, mapping it by handles of `kind`.

        `readers`: the checkpoint files the worker attached with (Lease.readers).
        """
        if not self._sets.holds(ts):
            raise UnknownSet(f"set {ts.set_id} was dropped while the worker waited; attach again")
        check_served(ts, intent)
        # A first lease of descriptors is granted, and charged to its uid, when
        # it collects them (COLLECT_DEADLINE_S): only then does the kernel say
        # who holds it, so uncollected ones count against no limit and cannot
        # shut out other users. Any other lease's uid is unknown until its
        # worker comes to the fd channel, and all of those together hold one
        # uid's share.
        collects = kind in ON_FD_CHANNEL and not intent.reattach
        if not collects:
            self._check_total()
            self._check_share(None)
        start = start_ticks(intent.pid) if intent.pid > 0 else None
        claimed = intent.pid_namespace == _PID_NAMESPACE and start == intent.pid_start
        lease = Lease(
            lease_id=secrets.token_hex(6),
            set_id=ts.set_id,
            backing=ts.backing.name,
            node=ts.node,
            pid=intent.pid,
            labels=dict(intent.labels),
            pid_start=start if claimed else None,
            stale=bool(
                intent.nonce and ts.manifest is not None and intent.nonce != ts.manifest.nonce
            ),
            kind=kind,
            device=intent.device,
            gpu_route=gpu_route,
            collects=collects,
            readers=readers,
        )
        if ts.state is SetState.FAILED_VERIFICATION:
            # A worker re-attaching to the copy it maps: it gets its lease back, and the news.
            lease.stale = True
            lease.told_stale.set()
        elif ts.replaced_by:
            # A later generation replaced the set: the worker hears where to move at once.
            lease.told_stale.set()
        ts.leases[lease.lease_id] = lease
        ts.last_used = time.monotonic()
        return lease

    async def redeem(self, lease_id: str, secret: str, caller: Caller) -> list[tuple[str, int]]:
        """The set's read-only descriptors (name, fd) for the caller holding a lease's secret.

        Spends the secret, charges the lease to the caller's uid and, where the
        caller's pid is visible, binds the lease to that process. Raises
        NotAllowed (no such lease, a wrong or spent secret, another process,
        a uid that may not read the checkpoint), TooManyLeases or
        SegmentNotVisible (the set is gone or cannot be opened). Once the
        secret matched, any refusal ends the lease: its secret was presented,
        so it can never serve its worker, and it must not keep its set held.
        A wrong secret ends nothing (lease ids are shown to the socket group).
        """
        found = self.find(lease_id)
        if (
            found is None
            or not found[1].fd_secret
            or not secrets.compare_digest(found[1].fd_secret, secret)
        ):
            raise NotAllowed(
                "no live lease with this id and an unused secret (the lease ended, or its "
                "descriptors were collected already); attach again"
            )
        ts, lease = found
        lease.fd_secret = ""
        try:
            return await self._redeemed(ts, lease, caller)
        except (NotAllowed, SegmentNotVisible, TooManyLeases) as e:
            self._end_refused(ts, lease, e)
            raise

    async def _redeemed(self, ts: TableSet, lease: Lease, caller: Caller) -> list[tuple[str, int]]:
        """The checks of `redeem` after the secret matched, and the descriptors."""
        if caller.own_pid is not None and caller.own_pid != lease.pid:
            raise NotAllowed(
                f"lease {lease.lease_id} belongs to pid {lease.pid}, not to the connecting "
                f"process (pid {caller.own_pid} in its namespace)"
            )
        if not ts.published:
            groups = caller.groups()
            # Read on a thread: a checkpoint's folder may sit on a network mount that hangs.
            if not await asyncio.to_thread(may_read, lease.readers, caller.uid, groups):
                raise NotAllowed(
                    f"uid {caller.uid} may not read the checkpoint files of lease "
                    f"{lease.lease_id} (set {ts.set_id} was loaded by a worker's attach, not "
                    f"published by the operator), judged with its groups {sorted(groups)} "
                    f"({caller.groups_from}): run the worker as a user that may read its "
                    "checkpoint (where the daemon cannot see its pid: by its primary group or "
                    "the socket's group), or have the operator load it (engramd load)"
                )
        if lease.ended.is_set():
            # Ended (by the sweep, a drop, the stream) while the files were judged.
            raise NotAllowed(f"lease {lease.lease_id} ended; attach again")
        if ts.state not in COMPLETE or ts.manifest is None:
            raise SegmentNotVisible(f"set {ts.set_id} is no longer held; attach again")
        self.own(lease, caller.uid)
        if caller.own_pid is not None:
            lease.pid, lease.pid_start = caller.pid, start_ticks(caller.pid)
            lease.pid_verified = True
        try:
            return ts.backing.descriptors(
                ts.manifest, lease.gpu_route == GpuRoute.REGISTER_WRITABLE
            )
        except NotOwned as e:
            raise SegmentNotVisible(
                f"set {ts.set_id} in the shm folder is not engramd's own ({e}): refusing to "
                "hand it out; drop it and load it again"
            ) from None
        except (OSError, ManifestError) as e:
            raise SegmentNotVisible(f"set {ts.set_id} cannot be opened ({e})") from None

    def _end_refused(self, ts: TableSet, lease: Lease, why: Exception) -> None:
        """End a lease whose presented secret was refused its descriptors."""
        log.info(
            "ending lease %s of set %s: refused its descriptors (%s)",
            lease.lease_id,
            ts.set_id,
            why,
        )
        lease.ended.set()
        if ts.leases.pop(lease.lease_id, None) is not None:
            ts.last_used = time.monotonic()

    def own(self, lease: Lease, uid: int) -> None:
        """Charge `lease` to `uid`, as the kernel named its holder; raises TooManyLeases.

        A first lease of descriptors is granted here: it counts against
        --max-leases from now on.
        """
        if lease.uid == uid:
            return
        if lease.collects and lease.uid is None:
            self._check_total(lease)
        self._check_share(uid)
        lease.uid = uid

    def _check_total(self, granting: Lease | None = None) -> None:
        """Raise TooManyLeases when the granted leases (but `granting`) reach --max-leases."""
        held = sum(
            1
            for ts in self._sets.all()
            for lease in ts.leases.values()
            if lease is not granting and not _uncollected(lease)
        )
        if self._max_leases and held >= self._max_leases:
            raise TooManyLeases(
                f"engramd holds {held} leases, its limit (--max-leases); stop idle workers "
                "or raise the limit"
            )

    def _check_share(self, uid: int | None) -> None:
        """Raise TooManyLeases when `uid` (None: leases of unknown uid) holds its share."""
        if not self._leases_per_uid:
            return
        held = sum(
            1
            for ts in self._sets.all()
            for lease in ts.leases.values()
            if lease.uid == uid and (uid is not None or not lease.collects)
        )
        if held < self._leases_per_uid:
            return
        who = (
            f"uid {uid}"
            if uid is not None
            else "workers whose uid engramd cannot know (path handles, no fd channel)"
        )
        raise TooManyLeases(
            f"{who} hold {held} leases, one user's share of engramd's leases "
            "(--leases-per-uid); stop idle workers or raise the share"
        )

    def end(self, lease: Lease) -> None:
        """Forget a lease (its stream closed)."""
        ts = self._sets.by_key(lease.set_key)
        if ts is not None and ts.leases.pop(lease.lease_id, None) is not None:
            ts.last_used = time.monotonic()

    def find(self, lease_id: str) -> tuple[TableSet, Lease] | None:
        """The set and the live lease with this id, if any."""
        for ts in self._sets.all():
            lease = ts.leases.get(lease_id)
            if lease is not None:
                return ts, lease
        return None

    def sweep_dead(self) -> int:
        """End leases whose process is gone, or that were not granted their descriptors in time.

        A pid that matched no process here is never judged: it may name
        another process here than the worker's (another pid namespace).
        Returns how many ended.
        """
        ended = 0
        now = time.monotonic()
        for ts in self._sets.all():
            for lease in list(ts.leases.values()):
                if lease.pid_start is not None and start_ticks(lease.pid) != lease.pid_start:
                    log.info(
                        "ending lease %s of set %s: pid %d is gone",
                        lease.lease_id,
                        ts.set_id,
                        lease.pid,
                    )
                elif (
                    lease.collects
                    and lease.uid is None
                    and now - lease.started > COLLECT_DEADLINE_S
                ):
                    # Never granted: never collected, or its collection is still being
                    # judged (a checkpoint folder on a hung mount) past the deadline.
                    log.info(
                        "ending lease %s of set %s: pid %d did not collect its descriptors "
                        "within %.0f s",
                        lease.lease_id,
                        ts.set_id,
                        lease.pid,
                        COLLECT_DEADLINE_S,
                    )
                else:
                    continue
                lease.ended.set()
                ts.leases.pop(lease.lease_id, None)
                ended += 1
        return ended

    def drain(self) -> None:
        """End every lease, telling each worker that the daemon is stopping."""
        for ts in self._sets.all():
            for lease in ts.leases.values():
                lease.draining = True
                lease.ended.set()

    @staticmethod
    def count(ts: TableSet) -> int:
        """How many leases `ts` holds (an idle set holds none)."""
        return len(ts.leases)

    @staticmethod
    def listed(ts: TableSet, limit: int | None = None) -> list[Lease]:
        """The leases of `ts` in the order they came: all, or the first `limit`."""
        return list(itertools.islice(ts.leases.values(), limit))

    @staticmethod
    def tell_stale(ts: TableSet) -> int:
        """Mark every lease of `ts` stale and tell its worker (its copy failed verification);
        returns how many."""
        for lease in ts.leases.values():
            lease.stale = True
            lease.told_stale.set()
        return len(ts.leases)

    @staticmethod
    def end_all(ts: TableSet) -> int:
        """End every lease of a set leaving the store; returns how many."""
        ended = len(ts.leases)
        for lease in ts.leases.values():
            lease.ended.set()
        ts.leases.clear()
        return ended


def check_served(ts: TableSet, intent: AttachIntent) -> None:
    """Raise the set's FailedVerification for a new attach of a copy that failed verification.

    A worker re-attaching (its stream broke) maps that copy already: it gets its lease
    back, marked stale, so status shows who still reads it.
    """
    if ts.state is SetState.FAILED_VERIFICATION and not intent.reattach:
        # A new exception each time: the stored one is status's, not every caller's traceback.
        raise FailedVerification(str(ts.error))


def _uncollected(lease: Lease) -> bool:
    """A first lease of descriptors whose worker has not come for them: granted once it does.

    One whose secret was presented counts from then on, while it is judged.
    """
    return lease.collects and lease.uid is None and bool(lease.fd_secret)
