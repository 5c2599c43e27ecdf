"""What the core asks of a part that fills sets from elsewhere (engramd/fleet): the seams.

The core never imports the fleet. The daemon's lifecycle builds the fleet
when a fleet flag is set and hands the set keeper a `Remote`: a fill source
the loader runs before it copies from the files, a planner for checkpoints
whose bytes are elsewhere (an object store's prefix: no files on this node),
and the attestor that checks what a filled set's manifest says of its origin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engramd.backings import StagedSet
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import CheckpointError


@dataclass(frozen=True)
class Filled:
    """What a fill source gives the loader: each tensor's checksum and strong digest of the
    bytes it wrote, and the attestation they were checked against (all kept in the published
    manifest)."""

    digests: list[str]
    strong: list[str]
    attestation: str


class FillProgress(Protocol):
    """The load's progress (sets.loader.LoadProgress) as a fill source drives it."""

    cancel: threading.Event

    #: Where the bytes come from, as status shows it.
    source: str

    def add(self, n: int, source: str = "") -> None:
        """Count `n` more bytes (from `source`, one of several); raises when the load is
        cancelled."""

    def restart(self, source: str) -> None:
        """Count again from nothing: the bytes now come from `source`."""


#: A fill source: fill the staged set of a plan (every byte reserved, nothing visible) on the
#: loader's thread, reporting progress; None: the loader copies from the files.
FillSource = Callable[[TablePlan, StagedSet, FillProgress], Filled | None]


class StoreUnreadable(CheckpointError):
    """The store did not give the objects of a checkpoint planned from it: unreachable,
    refused, too slow, or no S3 in its answers (not a checkpoint that is malformed)."""


class Attestable(Protocol):
    """What an attestation covers of a tensor (a manifest's, or an attested manifest's)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def checksum(self) -> str: ...


class Attestor(Protocol):
    """Checks an origin's attestation of a set (the fleet's key)."""

    def attested(
        self,
        attestation: str,
        set_id: str,
        fingerprint: str,
        tensors: Sequence[Attestable],
        strong: Sequence[str],
    ) -> bool:
        """Whether `attestation` covers exactly these tensors, checksums and strong digests."""
        ...


class ElsewherePlanner(Protocol):
    """Plans checkpoints whose bytes are not in files on this node (`is_store_url`)."""

    def plan(self, url: str, selection: str) -> TablePlan:
        """The plan of the checkpoint at `url`; blocks (run it on a thread). CheckpointError
        naming the problem, StoreUnreadable when its store did not answer."""
        ...

    def vouch(self, plan: TablePlan) -> None:
        """Return once an attestation the attestor accepts covers `plan`'s set; until then
        nothing is reserved for it. CheckpointError otherwise, StoreUnreadable when its
        store did not answer and nothing else vouched."""
        ...


@dataclass(frozen=True)
class Remote:
    """The seams a fleet offers the core; the lifecycle builds it (engramd/fleet)."""

    #: Runs before every load's copy from the files.
    fill: FillSource
    #: Plans checkpoints named by URL.
    planner: ElsewherePlanner
    #: The fleet's key, where the daemon has one (--peer-token-file): without it a
    #: checkpoint by URL cannot be trusted, and filled sets' attestations go unchecked.
    attestor: Attestor | None
