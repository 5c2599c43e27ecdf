"""`Tables`: a set's tensors by name, shared (over mapping.py's read-only mappings)
or private copies, with the lease that keeps a shared set served.

Live tables (live.py) keep each tensor's address for the worker's life and
move to what is pending at `advance()`, the step boundary: a worker that
fell back because the daemon was down moves to the daemon's copy once its
rejoin thread (rejoin.py) has that copy's descriptors in hand.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from engramd_client.live import Backing, LiveAddress, delta_for, private_backing
from engramd_client.mapping import Region, RowRanges, check_row_names, load_private, torch_dtype
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import DeviceError, NoCpuView
from engramd_shared.layout import lead

if TYPE_CHECKING:
    from engramd_client.cuda import Registration
    from engramd_client.lease import Lease

log = logging.getLogger("engramd_client")


@dataclass
class Move:
    """A backing for every live tensor, whole and in hand, to map at the next step boundary.

    Its descriptors are held here: the daemon that handed them out may stop
    before the move, and the move still maps one whole copy.
    """

    #: The new backing of each live tensor, by name.
    backings: dict[str, Backing]
    #: What the tables are after the move: "shared".
    mode: str
    #: The set id of the new backing.
    set_id: str
    #: The lease that keeps the new backing served (shared), or None.
    lease: Lease | None
    #: How a device reads the new backing (engramd_client.cuda.ROUTES).
    gpu_route: str = ""

    def discard(self) -> None:
        """Let go of what the move holds (it will not happen)."""
        for backing in self.backings.values():
            backing.close()
        if self.lease is not None:
            self.lease.close()


def _told(held: weakref.ref[Tables]) -> Callable[[str, int], None]:
    """What a lease calls with a set's next generation: the tables' own, held weakly (the
    lease's thread would otherwise keep tables nobody holds, and their addresses, alive)."""

    def told(set_id: str, generation: int) -> None:
        tables = held()
        if tables is not None:
            tables._next_generation(set_id, generation)

    return told


def _ready_generation(held: weakref.ref[Tables], set_id: str, generation: int) -> None:
    """Attach a set's next generation and offer its move; on failure the tables stay whole
    on the generation they map (the daemon keeps it while they lease it)."""
    tables = held()
    prepare = tables._prepare if tables is not None else None
    if tables is None or prepare is None:
        return
    was = tables.set_id
    del tables  # a long attach keeps no tables alive
    try:
        move = prepare(set_id)
    except Exception as e:
        tables = held()
        if tables is not None:
            tables._preparing = ""  # told again (the daemon back), it tries again
        log.warning(
            "engramd: cannot map generation %d of these tables (set %s): %s; they stay on set %s",
            generation,
            set_id,
            e,
            was,
        )
        return
    tables = held()
    if tables is None:
        move.discard()
        return
    why = tables.offer(move)
    tables._preparing = ""
    if why is not None:
        log.warning(
            "engramd: generation %d (set %s) cannot be mapped at these tables' addresses (%s); "
            "they stay on set %s until the engine restarts",
            generation,
            set_id,
            why,
            was,
        )


def _close_all(backings: list[Backing]) -> None:
    """Close backings: their pages go once no mapping holds them (a private copy's at once)."""
    for backing in backings:
        backing.close()


class Tables(Mapping[str, torch.Tensor]):
    """The tensors of a table set, by name; shared (read-only mappings) or private.

    Use as a mapping (`tables[name]`, `list(tables)`) and close it, or use it as
    a context manager. Closing ends the lease; the memory goes when the last
    tensor taken from it is garbage collected.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        mode: str,
        set_id: str,
        reason: str | None = None,
        lease: Lease | None = None,
        parts: Mapping[str, tuple[str, ...]] | None = None,
        live: dict[str, LiveAddress] | None = None,
        backings: dict[str, Backing] | None = None,
    ) -> None:
        self._tensors = tensors
        self._lease = lease
        self._parts = dict(parts or {})
        #: "shared" or "private".
        self.mode = mode
        #: Why the tables are private (the warning's text), or None.
        self.reason = reason
        #: The set id of these tables.
        self.set_id = set_id
        #: How `attach` made these tables: `refresh` calls it again.
        self.reattach: Callable[[], Tables] | None = None
        self._when_closed: list[Callable[[], None]] = []
        self._names = list(tensors)
        self._views: dict[str, torch.Tensor] = {}
        #: The CUDA device of the tables' CUDA views (`cuda`), or None.
        self.device: torch.device | None = None
        #: How the device reads the tables (engramd_client.cuda.ROUTES), "" without one.
        self.gpu_route = ""
        # Live tensors: their fixed addresses and what backs each now.
        self._live: dict[str, LiveAddress] = dict(live or {})
        self._backings: dict[str, Backing] = dict(backings or {})
        self._registrations: dict[str, Registration] = {}
        # Set by the rejoin thread (or a generation's), taken by advance() in the engine's
        # step thread.
        self._pending: Move | None = None
        # Readies the move to a set's next generation (follow_generations), or None; the
        # set id it readies a move to now ("" when none).
        self._prepare: Callable[[str], Move] | None = None
        self._preparing = ""
        self._pending_lock = threading.Lock()
        self._until_shared: list[Callable[[], None]] = []
        self._on_move: list[Callable[[], None]] = []
        #: Stops the thread that looks for the daemon (rejoin.py); None without one.
        self.stop_rejoin: Callable[[], None] | None = None
        self._freeing: threading.Thread | None = None

    @classmethod
    def private(
        cls,
        plan: TablePlan,
        rows: RowRanges | None,
        reason: str | None,
        thp: bool = True,
        pad_rows: bool = False,
    ) -> Tables:
        """Private copies of a plan's tensors, read from the checkpoint (on THP with `thp`)."""
        check_row_names(rows, [t.name for t in plan.tensors])
        tensors = {t.name: load_private(t, rows, thp, pad_rows) for t in plan.tensors}
        return cls(
            tensors,
            mode="private",
            set_id=plan.set_id,
            reason=reason,
            parts=plan.checkpoint_names,
        )

    @classmethod
    def private_live(
        cls, plan: TablePlan, rows: RowRanges | None, reason: str | None, pad_rows: bool = False
    ) -> Tables:
        """Private copies of a plan's tensors at live addresses (live.py), read from the
        checkpoint: `advance()` can move them to the daemon's copy at the same addresses."""
        check_row_names(rows, [t.name for t in plan.tensors])
        tensors: dict[str, torch.Tensor] = {}
        live: dict[str, LiveAddress] = {}
        backings: dict[str, Backing] = {}
        try:
            for entry in plan.tensors:
                region = Region(
                    entry.name, entry.dtype, entry.shape, str(entry.file), 0, entry.nbytes
                ).cut(rows, pad_rows)
                dtype = torch_dtype(region.dtype)
                if region.length + region.pad == 0:
                    tensors[entry.name] = torch.empty(region.shape, dtype=dtype)
                    continue
                # The daemon's files put each tensor at its lead: its rows then fall, within
                # their pages, where the daemon's copy has them.
                address = LiveAddress(
                    region.length + region.pad, delta_for(lead(entry) + region.offset)
                )
                backing = private_backing(entry, region, address)
                backings[entry.name] = backing
                address.apply(backing)
                live[entry.name] = address
                tensors[entry.name] = address.tensor(dtype, region.shape)
        except BaseException:
            for backing in backings.values():
                backing.close()
            raise
        return cls(
            tensors,
            mode="private",
            set_id=plan.set_id,
            reason=reason,
            parts=plan.checkpoint_names,
            live=live,
            backings=backings,
        )

    @property
    def live(self) -> bool:
        """Whether the tensors' addresses stay while what backs them moves (`advance()`)."""
        return bool(self._live)

    def live_regions(self) -> dict[str, LiveAddress]:
        """The live tensors' address ranges, by name (a rejoin maps its backings there)."""
        return dict(self._live)

    @property
    def pending(self) -> bool:
        """A move waits for the next `advance()`."""
        return self._pending is not None

    @property
    def heading(self) -> str:
        """The set these tables are on once the next `advance()` ran: a pending move's,
        else their own ("" for private tables with nothing pending). The ranks of an engine
        move together once every rank heads for the same set (engines.common.StepGate)."""
        move = self._pending
        if move is not None:
            return move.set_id
        return self.set_id if self.mode == "shared" else ""

    def follow_generations(self, prepare: Callable[[str], Move]) -> None:
        """Move to each next generation of the set the daemon names (the operator loaded a
        new revision: engramd.sets.generations): `prepare(set_id)` attaches it and maps
        nothing, in a thread of its own; the next `advance()` makes the move."""
        self._prepare = prepare
        if self._lease is not None:
            self._lease.on_next_generation(_told(weakref.ref(self)))

    def _next_generation(self, set_id: str, generation: int) -> None:
        with self._pending_lock:
            heading = self._pending.set_id if self._pending is not None else self.set_id
            if set_id in (heading, self._preparing):
                return  # told again (a re-established lease): already on its way
            self._preparing = set_id
        log.info(
            "engramd: these tables move to generation %d (set %s) at a step boundary once it "
            "is mapped",
            generation,
            set_id,
        )
        threading.Thread(
            target=_ready_generation,
            args=(weakref.ref(self), set_id, generation),
            name="engramd-generation",
            daemon=True,
        ).start()

    def offer(self, move: Move) -> str | None:
        """Make `move` the one the next `advance()` makes; why not (it is discarded), or None.

        Every live tensor gets a backing that fits its range, or nothing moves.
        """
        why = None
        if set(move.backings) != set(self._live):
            why = f"it backs {sorted(move.backings)[:4]}, not {sorted(self._live)[:4]}"
        for name, backing in move.backings.items():
            if why is None and name in self._live:
                misfit = self._live[name].misfit(backing)
                why = f"{name}: {misfit}" if misfit else None
        with self._pending_lock:
            if why is None and not self._live:
                why = "these tables are closed"
            if why is not None:
                move.discard()
                return why
            old, self._pending = self._pending, move
        if old is not None:
            old.discard()
        return None

    def advance(self, to: str | None = None) -> bool:
        """Move the tables to what is pending (the step boundary); nearly free when nothing is.

        Call it where no step reads the tables (the engines' plugins call it
        where the engine starts a step, on every rank at the same step). The
        tensors keep their addresses; what backed them before is freed. True
        when the tables moved. `to`: move only to that set (the one an engine's
        ranks agreed on, `heading` before their vote); a move that became
        pending since stays pending for the next vote.
        """
        if self._pending is None:
            return False
        with self._pending_lock:
            move = self._pending
            if move is None or (to is not None and move.set_id != to):
                return False
            self._pending = None
        self._move(move)
        return True

    def _move(self, move: Move) -> None:
        """Map `move`'s backings under the live addresses, all of them or (undone) none."""
        device = self.device
        if device is not None:
            # Nothing of an earlier step may still read the pages on the device.
            torch.cuda.synchronize(device)
            self._unregister()
        done: list[str] = []
        try:
            for name, backing in move.backings.items():
                self._live[name].apply(backing)
                done.append(name)
        except BaseException:
            for name in done:
                self._live[name].apply(self._backings[name])
            move.discard()
            if device is not None:
                self._reregister(self.gpu_route)
            raise
        old, self._backings = self._backings, dict(move.backings)
        # Freeing a private copy's pages takes about as long as mapping the new ones (0.1 s
        # a GiB here): off the step, in a thread of its own.
        self._freeing = threading.Thread(
            target=_close_all, args=(list(old.values()),), name="engramd-free", daemon=True
        )
        self._freeing.start()
        was = self.mode
        if device is not None:
            self._reregister(move.gpu_route or self.gpu_route)
        if self._lease is not None:
            self._lease.close()
        self._lease = move.lease
        self.mode, self.set_id, self.reason = move.mode, move.set_id, None
        if self._prepare is not None and self._lease is not None:
            self._lease.on_next_generation(_told(weakref.ref(self)))
        if move.mode == "shared":
            callbacks, self._until_shared = self._until_shared, []
            for callback in reversed(callbacks):
                callback()
        for callback in self._on_move:
            callback()
        log.info(
            "engramd tables moved from %s to %s (set %s, %d tensors, same addresses)",
            f"{was} copy",
            "the daemon's copy" if move.mode == "shared" else f"a {move.mode} copy",
            self.set_id,
            len(self._live),
        )

    def when_moved(self, callback: Callable[[], None]) -> None:
        """Call `callback` at the step boundary, after every move (advance() returned True):
        what holds a mapping of its own of these tables' rows (a row reader over other
        addresses) takes the new ones there."""
        self._on_move.append(callback)

    def until_shared(self, callback: Callable[[], None]) -> None:
        """Call `callback` when these private tables move to the daemon's copy, or close
        (a fallen-back worker's record beside the socket goes then)."""
        self._until_shared.append(callback)

    @property
    def checkpoint_names(self) -> frozenset[str]:
        """The checkpoint's names of the tensors these tables hold (a joined table's shards)."""
        return frozenset(p for name in self._names for p in self._parts.get(name, (name,)))

    @property
    def lease_id(self) -> str | None:
        """The daemon's id of this worker's lease (shared mode), or None."""
        return self._lease.lease_id if self._lease else None

    @property
    def stale(self) -> bool:
        """The daemon holds a newer copy of the set than this one (dropped and loaded again),
        or told this worker its copy failed verification (`engramd verify` found changed
        bytes): `refresh()` attaches again (private tables, in auto mode, while the set
        is not loaded again)."""
        return self._lease is not None and self._lease.stale

    def refresh(self) -> Tables:
        """Attach again, as `attach` did for these tables; close these once the new ones are bound.

        Mappings are never swapped under live tensors: the model binds the
        tensors of the returned Tables (a stale worker moves to the new copy).
        """
        if self.reattach is None:
            raise ValueError("these tables were not made by attach(); attach again instead")
        return self.reattach()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors handed out (row ranges only, when given)."""
        tensors = self._tensors or self._views
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors and name in self._views:
            raise NoCpuView(
                f"{name!r} of set {self.set_id} lives in GPU memory (engramd's cuda-device "
                f"backing): use tables.cuda({name!r}), its CUDA view"
            )
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def register_on(self, index: int, route: str) -> None:
        """Make every tensor readable on CUDA device `index` in place, by `route` (attach(device=)).

        `route` is one of engramd_client.cuda.ROUTES other than cumem-import.
        """
        from engramd_client.cuda import register_all

        self._registrations = register_all(self._tensors, index, route)
        self.gpu_route = route
        views = {n: r.view for n, r in self._registrations.items()}
        self.set_views(views, index, self._unregister)

    def _unregister(self) -> None:
        for registration in self._registrations.values():
            registration.release()

    def _reregister(self, route: str) -> None:
        """Register the live tensors' new pages at the same addresses, for the same views.

        A device that cannot use host pointers for registered memory may give
        another device pointer, which CUDA graphs captured before would not see.
        """
        from engramd_client.cuda import register_all

        assert self.device is not None
        index = self.device.index or 0
        registrations = register_all(self._tensors, index, route)
        for name, registration in registrations.items():
            if registration.view.data_ptr() != self._views[name].data_ptr():
                for fresh in registrations.values():
                    fresh.release()
                raise DeviceError(
                    f"{name} moved on {self.device}: its registered pages have another device "
                    "address; this device cannot keep live tables at one address"
                )
        self._registrations = registrations
        self.gpu_route = route

    def set_views(
        self, views: dict[str, torch.Tensor], index: int, release: Callable[[], None]
    ) -> None:
        """Give the tables CUDA views on device `index`; `close()` calls `release` for them."""
        if self.device is not None:
            raise ValueError(f"these tables have CUDA views on {self.device} already")
        self._views = views
        self._names = self._names or list(views)
        self.device = torch.device("cuda", index)
        self.when_closed(release)

    def cuda(self, name: str) -> torch.Tensor:
        """The tensor `name` on the CUDA device, read in place (no copy): host pages over UVA,
        or the GPU's own memory for a set of engramd's cuda-device backing.

        Valid until `close()`, which unregisters or unmaps the memory.
        """
        if self.device is None:
            raise ValueError(
                "these tables have no CUDA views: attach with device='cuda:N' (or ENGRAMD_DEVICE)"
            )
        return self._views[name]

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback` when these tables close, the latest first.

        bind() undoes its bindings there, before the CUDA views they may hold are
        released (set_views registered that first).
        """
        self._when_closed.append(callback)

    def close(self) -> None:
        """Undo bindings, release CUDA views, end the lease (if shared), drop the references."""
        if self.stop_rejoin is not None:
            self.stop_rejoin()
            self.stop_rejoin = None
        with self._pending_lock:
            move, self._pending = self._pending, None
            live, self._live = self._live, {}
        if move is not None:
            move.discard()
        self._prepare = None
        callbacks = self._until_shared + self._when_closed
        self._until_shared, self._when_closed, self._on_move = [], [], []
        self._views, self.device = {}, None
        for callback in reversed(callbacks):
            callback()
        if self._lease is not None:
            self._lease.close()
            self._lease = None
        if self._freeing is not None:
            self._freeing.join()
        _close_all(list(self._backings.values()))
        self._backings = {}
        del live
        self._tensors, self._names = {}, []

    def __enter__(self) -> Tables:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Tables(mode={self.mode!r}, set_id={self.set_id!r}, tensors={len(self)}, "
            f"nbytes={self.nbytes})"
        )
