"""`engramd load`'s progress bar (rich), on stderr: bytes, percent, throughput, time left."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class AverageRate(ProgressColumn):
    """Bytes per second since the load started, in GB/s as the daemon logs loads.

    rich's TransferSpeedColumn averages recent samples only, and shows "?"
    for a load over before it has two.
    """

    def render(self, task: Task) -> Text:
        """The task's throughput so far."""
        elapsed = task.elapsed or 0.0
        if not elapsed:
            return Text("")
        return Text(f"{task.completed / elapsed / 1e9:.2f} GB/s")


def load_bar() -> Progress:
    """A progress bar for one load; use as a context manager, update one task with bytes."""
    return Progress(
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),
        AverageRate(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
