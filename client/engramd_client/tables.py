"""`Tables`: a set's tensors by name, shared (over mapping.py's read-only mappings)
or private copies, with the lease that keeps a shared set served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from engramd_client.mapping import RowRanges, check_row_names, load_private
from engramd_shared.checkpoint import TablePlan
from engramd_shared.errors import NoCpuView

if TYPE_CHECKING:
    from engramd_client.lease import Lease


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

        registrations = register_all(self._tensors, index, route)
        self.gpu_route = route

        def release() -> None:
            for registration in registrations.values():
                registration.release()

        self.set_views({n: r.view for n, r in registrations.items()}, index, release)

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
        callbacks, self._when_closed = self._when_closed, []
        self._views, self.device = {}, None
        for callback in reversed(callbacks):
            callback()
        if self._lease is not None:
            self._lease.close()
            self._lease = None
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
