"""The daemon's settings. `engramd serve` fills them from flags and ENGRAMD_* variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from engramd_client.checkpoint import DEFAULT_TENSORS
from engramd_client.config import DEFAULT_SOCKET


@dataclass
class DaemonConfig:
    """Everything `create_server` needs; every field has a working default."""

    #: Checkpoint folders whose sets are loaded at start (health SERVING once all are ready).
    checkpoints: list[str] = field(default_factory=list)
    #: fnmatch selection of the tensors that make a set.
    tensors: str = DEFAULT_TENSORS
    #: Unix socket of the TableService and the health service.
    socket: str = DEFAULT_SOCKET
    #: tmpfs folder that holds the sets (under <shm_dir>/engramd/).
    shm_dir: str = "/dev/shm"
    #: Roots under which a worker's attach may start a load; none by default.
    allow_roots: list[str] = field(default_factory=list)
    #: Unlink every set at shutdown instead of keeping it for a fast restart.
    drop_on_exit: bool = False
    #: Lock each set's pages in memory (mlock) so they are never swapped out.
    mlock: bool = True
    #: Threads that copy tensors into tmpfs during a load.
    load_threads: int = 2
    #: Seconds in-flight RPCs get to finish at shutdown before they are cancelled.
    grace_s: float = 5.0
    #: Seconds between sweeps that end leases of workers whose process is gone.
    sweep_interval_s: float = 1.0
