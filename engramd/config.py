"""The daemon's settings: `engramd serve` fills them from flags, ENGRAMD_* and --config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engramd_client.core.checkpoint import DEFAULT_TENSORS
from engramd_client.core.config import DEFAULT_SOCKET

#: Every `--backing` value: the names engramd.backings registers (BACKINGS, then COMBINED).
#: Written out here so that the CLI's help need not import the backings, whose CUDA
#: lookups and mapping helpers cost every command a tenth of a second; a test keeps
#: the two in step.
BACKING_NAMES = ("tmpfs", "hugetlbfs", "memfd", "cuda-host", "cuda-device", "auto")
#: `--backing cuda-device:N`: GPU N's memory.
CUDA_DEVICE_PREFIX = "cuda-device:"


def admin_socket_for(socket_path: str) -> str:
    """The admin socket beside a worker socket (the default)."""
    return str(Path(socket_path).with_name("admin.sock"))


@dataclass
class DaemonConfig:
    """Everything `create_server` needs; every field has a working default."""

    #: Checkpoint folders whose sets are loaded at start (health SERVING once all are ready).
    checkpoints: list[str] = field(default_factory=list)
    #: fnmatch selection of the tensors that make a set.
    tensors: str = DEFAULT_TENSORS
    #: Unix socket of the TableService and the health service (0660).
    socket: str = DEFAULT_SOCKET
    #: Unix socket of the AdminService (load, drop, verify; 0600); "": admin.sock beside `socket`.
    admin_socket: str = ""
    #: Unix socket of the fd channel (read-only descriptors, 0660); "": fds.sock beside `socket`.
    fd_socket: str = ""
    #: Group that may attach: owns the socket, its folder and the sets' files.
    socket_group: str = "engramd"
    #: Where sets live: a name in engramd.backings.BACKINGS ("cuda-device:N" for GPU N), or
    #: "auto" (tmpfs, else memfd).
    backing: str = "tmpfs"
    #: memfd sets on hugetlb pages of this size (2 MiB or 1 GiB; MFD_HUGETLB); 0: the kernel's.
    page_size: int = 0
    #: Where a set's pages go: "" (the kernel's choice), "interleave", "node:N", "per-node".
    numa: str = ""
    #: tmpfs (or hugetlbfs) folder that holds the sets (under <shm_dir>/engramd/).
    shm_dir: str = "/dev/shm"
    #: Accept a shm folder on a disk filesystem: the tables then go to disk and the page cache.
    allow_disk_backed_tables: bool = False
    #: Mount a huge=within_size tmpfs over <shm_dir>/engramd where the daemon may (2 MiB pages).
    huge_tmpfs: bool = True
    #: Roots under which a worker's attach may start a load; none by default.
    allow_roots: list[str] = field(default_factory=list)
    #: Most bytes of sets the daemon holds at once; 0 for no limit but the tmpfs.
    memory_budget: int = 0
    #: Make room within the budget by dropping sets no worker holds, oldest first.
    evict_idle: bool = False
    #: Recompute the checksums of sets adopted at start; drop the corrupted ones.
    verify: bool = False
    #: Unlink every set at shutdown instead of keeping it for a fast restart.
    drop_on_exit: bool = False
    #: Lock each set's pages in memory (mlock) so they are never swapped out.
    mlock: bool = True
    #: Threads that copy tensors into tmpfs during a load.
    load_threads: int = 2
    #: TCP port for gRPC health checks only (Kubernetes probes); 0: none.
    health_port: int = 0
    #: Address of the health port.
    health_address: str = "127.0.0.1"
    #: TCP port for Prometheus metrics; 0: none.
    metrics_port: int = 0
    #: Address of the metrics port.
    metrics_address: str = "127.0.0.1"
    #: Seconds in-flight RPCs get to finish at shutdown before they are cancelled.
    grace_s: float = 5.0
    #: Seconds between sweeps that end leases of workers whose process is gone.
    sweep_interval_s: float = 1.0
    #: Seconds after start before an adopted set without leases counts as idle
    #: (its workers re-attach within a few seconds of a restart).
    adopt_grace_s: float = 30.0
    #: Most leases held at once, all sets together; 0 for no limit.
    max_leases: int = 4096
    #: Workers that say their GPU cannot register read-only memory get writable descriptors
    #: of tmpfs/hugetlbfs sets (registered with flags 0): any member of the socket group may
    #: say so, and could then change the one copy every worker reads (`engramd verify` finds
    #: it). Off: such workers go private.
    allow_writable_gpu_mappings: bool = False
    #: Most leases one uid holds at once, as the kernel tells the uid (on the fd channel);
    #: leases whose uid the daemon cannot know (path handles) share one such share. 0: none.
    leases_per_uid: int = 1024
    #: fd channel exchanges one uid holds at once (SO_PEERCRED); the channel's whole cap is 64.
    fd_connections_per_uid: int = 8
    #: Seconds a worker-socket connection may stay idle (no call in flight, or no
    #: handshake) before the daemon closes it.
    idle_timeout_s: float = 60.0
    #: Descriptors the worker socket's connections never take: kept for the admin
    #: socket, the fd channel and the sets' files.
    fd_reserve: int = 256
