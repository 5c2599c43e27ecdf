"""The daemon's settings: each field declares its `engramd serve` flag, once.

A field's `setting(...)` gives its default and its flag's help; its flag is
`--<field>` (or the `option` it names), its variable ENGRAMD_<FLAG>, its
--config key the flag's name. engramd/cli/serve.py builds the command from
these declarations and parses each value once (`parse`), so the server and
the backings get typed values. Adding a flag is adding a field here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from engramd.units import parse_size
from engramd.values import BACKING_NAMES, BackingSpec, Placement
from engramd_shared.checkpoint import DEFAULT_TENSORS, is_store_url
from engramd_shared.config import DEFAULT_SOCKET

#: The key of a field's Setting in its metadata.
SETTING = "setting"
#: Every variable the daemon reads starts with this.
ENV_PREFIX = "ENGRAMD_"


def admin_socket_for(socket_path: str) -> str:
    """The admin socket beside a worker socket (the default)."""
    return str(Path(socket_path).with_name("admin.sock"))


def path(text: str) -> str:
    """A path as the command line gives it, in pathlib's spelling (no trailing slash)."""
    return str(Path(text))


def checkpoint(text: str) -> str:
    """A checkpoint folder as `path` spells it, or an object store's s3://bucket/prefix
    without its trailing slash."""
    return "s3://" + text[len("s3://") :].rstrip("/") if is_store_url(text) else path(text)


@dataclass(frozen=True)
class Setting:
    """How `engramd serve` sets one field of DaemonConfig."""

    #: The flag's help.
    help: str
    #: The flag's name where it is not the field's ("--checkpoint" for `checkpoints`).
    option: str = ""
    #: The field's value from the flag's text, for a field that is not a str, int, float,
    #: bool or list of str (sizes, the backing, the placement).
    parse: Callable[[str], Any] | None = None
    #: The least value of a number.
    min: float | None = None


def setting(
    default: Any,
    help: str,
    *,
    option: str = "",
    parse: Callable[[str], Any] | None = None,
    min: float | None = None,
) -> Any:
    """A DaemonConfig field with its default and its flag (a list default: a fresh one each)."""
    meta = {SETTING: Setting(help, option, parse, min)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Flag:
    """A DaemonConfig field as `engramd serve` takes it: flag, variable, --config key, type."""

    #: The DaemonConfig field it fills.
    field: str
    #: The flag, "--grace".
    option: str
    #: Its environment variable, "ENGRAMD_GRACE".
    env: str
    #: The field's type.
    type: Any
    #: The field's default (a fresh list for a list).
    default: Any
    #: What the field declares: help, parse, least value.
    setting: Setting

    @property
    def key(self) -> str:
        """Its key in a --config file (the flag's name; "-" or "_" between words)."""
        return self.option.removeprefix("--").replace("-", "_")


def flags() -> list[Flag]:
    """Every `engramd serve` flag of DaemonConfig, in the fields' order."""
    types = typing.get_type_hints(DaemonConfig)
    found = []
    for f in fields(DaemonConfig):
        s: Setting = f.metadata[SETTING]
        option = s.option or "--" + f.name.replace("_", "-")
        default = f.default if f.default_factory is MISSING else f.default_factory()
        env = ENV_PREFIX + option.removeprefix("--").replace("-", "_").upper()
        found.append(Flag(f.name, option, env, types[f.name], default, s))
    return found


#: What a --config file's value must be, by the type a field declares.
_EXPECTED: dict[Any, str] = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "text in quotes",
}
#: TOML's names of the values a file may hold.
_TOML_TYPES: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "text",
    list: "an array",
    dict: "a table",
}


def expected(flag: Flag) -> str:
    """What a --config file must give `flag`'s key, from the field's declaration."""
    one = _expected_one(flag)
    if typing.get_origin(flag.type) is list:
        return f"{one}, or an array of them"
    return one


def _expected_one(flag: Flag) -> str:
    if flag.setting.parse is parse_size:
        return 'a size: a number of bytes, or text with a unit ("2M", "200G")'
    if flag.setting.parse is not None:
        return "text in quotes"
    return _EXPECTED.get(flag.type, "text in quotes")


def toml_value_error(flag: Flag, value: object) -> str | None:
    """Why `value`, as a --config file gives it, cannot be `flag`'s (None: it can).

    Judged from the field's declared type (and its parse), for every setting
    alike: TOML's true/false for a switch, a number for a number, text for a
    path or a name, a number or text for a size.
    """
    items = value if typing.get_origin(flag.type) is list and isinstance(value, list) else [value]
    if all(_fits(flag, v) for v in items):
        return None
    return f"expected {expected(flag)}, got {value!r} ({_TOML_TYPES.get(type(value), 'a value')})"


def _fits(flag: Flag, value: object) -> bool:
    if flag.setting.parse is parse_size:
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    if flag.setting.parse is not None or typing.get_origin(flag.type) is list:
        return isinstance(value, str)
    if flag.type is bool:
        return isinstance(value, bool)
    if flag.type is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if flag.type is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)


@dataclass
class DaemonConfig:
    """Everything `create_server` needs; every field has a working default."""

    #: Checkpoints (folders, or s3://bucket/prefix) whose sets are loaded at start (health
    #: SERVING once all are ready).
    checkpoints: list[str] = setting(
        [],
        "Checkpoint folder to load at start, or s3://bucket/prefix for one this node holds "
        "no files of (repeatable; ENGRAMD_CHECKPOINT takes space-separated ones).",
        option="--checkpoint",
        parse=checkpoint,
    )
    #: fnmatch selection of the tensors that make a set; auto: each checkpoint's family's.
    tensors: str = setting(
        DEFAULT_TENSORS,
        "Tensors that make a set (fnmatch); auto: the n-gram tables of the checkpoint's "
        "family (DeepSeek-V4.1 Engram, Qwen4Exp PLE).",
    )
    #: Unix socket of the TableService and the health service (0660).
    socket: str = setting(DEFAULT_SOCKET, "The daemon's Unix socket.")
    #: Unix socket of the AdminService (load, drop, verify; 0600); "": admin.sock beside `socket`.
    admin_socket: str = setting(
        "", "The daemon's admin socket (default: admin.sock beside --socket)."
    )
    #: Unix socket of the fd channel (read-only descriptors, 0660); "": fds.sock beside `socket`.
    fd_socket: str = setting("", "The fd channel's socket (default: fds.sock beside --socket).")
    #: Group that may attach: owns the socket, its folder and the sets' files.
    socket_group: str = setting("engramd", "Group that may attach (socket, sets).")
    #: Where sets live: a backing of engramd.backings (auto: tmpfs, else memfd).
    backing: BackingSpec = setting(
        BackingSpec(),
        f"Where sets live: {', '.join(BACKING_NAMES)} (auto: tmpfs when the shm folder can "
        "hold the set, else memfd; disk: files in --disk-dir; cuda-device:N: GPU N's memory).",
        parse=BackingSpec.parse,
    )
    #: memfd sets on hugetlb pages of this size (2 MiB or 1 GiB; MFD_HUGETLB); 0: the kernel's.
    page_size: int = setting(
        0, "memfd sets on hugetlb pages: 2M or 1G (0: the kernel's pages).", parse=parse_size
    )
    #: Where a set's pages go (the kernel's choice by default).
    numa: Placement = setting(
        Placement(),
        "Where sets' pages go: interleave, node:N, or per-node (a copy on every node, each "
        "worker mapping its node's; default: the kernel's choice).",
        parse=Placement.parse,
    )
    #: tmpfs (or hugetlbfs) folder that holds the sets (under <shm_dir>/engramd/).
    shm_dir: str = setting(
        "/dev/shm", "tmpfs or hugetlbfs folder for the sets (detected).", parse=path
    )
    #: Local disk folder that holds the sets of --backing disk (under <disk_dir>/engramd/).
    disk_dir: str = setting(
        "/var/lib/engramd/tables",
        "Local disk folder for --backing disk's sets: tables larger than memory, served "
        "from the page cache, kept across reboots.",
        parse=path,
    )
    #: Read each disk set into the page cache once it is ready or adopted, within free memory.
    warm_page_cache: bool = setting(
        True,
        "Read each --backing disk set into the page cache once, when it is ready or adopted: "
        "within the memory the node can spare (less 1 GiB), stopped under memory pressure.",
    )
    #: Accept a shm folder on a disk filesystem: the tables then go to disk and the page cache.
    allow_disk_backed_tables: bool = setting(
        False,
        "Accept a --shm-dir that is not tmpfs or hugetlbfs: the tables are written to disk "
        "and served from the page cache, which the kernel may evict.",
    )
    #: Mount a huge=within_size tmpfs over <shm_dir>/engramd where the daemon may (2 MiB pages).
    huge_tmpfs: bool = setting(
        True,
        "Mount a tmpfs with 2 MiB pages (huge=within_size) over <shm-dir>/engramd where "
        "engramd may (CAP_SYS_ADMIN, the host's mount namespace) and the folder holds no sets.",
    )
    #: Roots under which a worker's attach may start a load; none by default.
    allow_roots: list[str] = setting(
        [],
        "Folder under which a worker's attach may start a load (repeatable).",
        option="--allow-root",
        parse=path,
    )
    #: Most bytes of sets the daemon holds at once; 0 for no limit but the tmpfs.
    memory_budget: int = setting(0, "Most bytes of sets held (0: no limit).", parse=parse_size)
    #: Make room within the budget by dropping sets no worker holds, oldest first.
    evict_idle: bool = setting(
        False, "Drop unleased sets, oldest first, to stay within the budget."
    )
    #: Recompute the checksums of sets adopted at start; drop the corrupted ones.
    verify: bool = setting(False, "Recompute checksums of adopted sets.")
    #: Unlink every set at shutdown instead of keeping it for a fast restart.
    drop_on_exit: bool = setting(False, "Remove the sets at shutdown.")
    #: Lock each set's pages in memory (mlock) so they are never swapped out.
    mlock: bool = setting(True, "Lock the sets' pages in memory.")
    #: Threads that read a checkpoint into a set's pages during a load; 0: sized to the
    #: checkpoint's block device and the cores (engramd.sets.loader.reads_for).
    load_threads: int = setting(
        0,
        "Threads that copy a set (0: to fill the device's queue, a core each at least, 4-32).",
        min=0,
    )
    #: TCP port for gRPC health checks only (Kubernetes probes); 0: none.
    health_port: int = setting(0, "TCP port for gRPC health (0: off).")
    #: Address of the health port.
    health_address: str = setting("127.0.0.1", "Address of the health port.")
    #: TCP port for Prometheus metrics; 0: none.
    metrics_port: int = setting(0, "TCP port for metrics (0: off).")
    #: Address of the metrics port.
    metrics_address: str = setting("127.0.0.1", "Address of the metrics port.")
    #: Where this daemon serves its operator-published sets to peers (gRPC over TCP); "": never.
    peer_listen: str = setting(
        "",
        "HOST:PORT to serve operator-published sets to peer daemons on (gRPC over TCP, "
        "bytes through NIXL; needs --peer-token-file). Off by default.",
    )
    #: Peers a new set's bytes may come from, before the object store and the files.
    peers: list[str] = setting(
        [],
        "Peer daemon HOST:PORT to fill sets from (repeatable, or comma-separated); a name that "
        "resolves to several addresses (a headless Service) is every one of them.",
    )
    #: The fleet's shared secret, both to serve peers and to fill from them.
    peer_token_file: str = setting(
        "",
        "File holding the peer token (a Kubernetes Secret); needed by --peer-listen and --peers.",
    )
    #: Bytes per second this daemon serves to all peers together; 0: no cap.
    peer_rate: int = setting(
        0, "Most bytes per second served to peers, all together (0: no cap).", parse=parse_size
    )
    #: A fill from a peer slower than this (bytes per second) moves on to the next source.
    peer_min_rate: int = setting(
        0,
        "Bytes per second below which a fill from a peer is abandoned for the next source "
        "(0: no floor).",
        parse=parse_size,
    )
    #: s3://bucket/prefix holding the checkpoint's files (their names as in the folder).
    object_store: str = setting(
        "",
        "s3://bucket/prefix holding the checkpoint's safetensors files: a source of pieces "
        "beside the peers, and of the whole set when no peer offers it, before the files "
        "(endpoint and keys as the AWS tools take them: "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).",
    )
    #: Seconds in-flight RPCs get to finish at shutdown before they are cancelled.
    grace: float = setting(5.0, "Seconds in-flight calls get at shutdown (SIGTERM).")
    #: Seconds between sweeps that end leases of workers whose process is gone.
    sweep_interval: float = setting(1.0, "Seconds between sweeps for leases of exited workers.")
    #: Seconds after start before an adopted set without leases counts as idle
    #: (its workers re-attach within a few seconds of a restart).
    adopt_grace: float = setting(
        30.0, "Seconds an adopted set is kept from eviction while its workers re-attach."
    )
    #: Most leases held at once, all sets together; 0 for no limit.
    max_leases: int = setting(4096, "Most leases held at once (0: no limit).", min=0)
    #: Workers that say their GPU cannot register read-only memory get writable descriptors
    #: of tmpfs/hugetlbfs sets (registered with flags 0): any member of the socket group may
    #: say so, and could then change the one copy every worker reads (`engramd verify` finds
    #: it). Off: such workers go private.
    allow_writable_gpu_mappings: bool = setting(
        False,
        "Hand writable descriptors of tmpfs sets to workers that say their GPU cannot "
        "register read-only memory: any member of the socket group may say so, and could "
        "then change the one copy every worker reads (engramd verify finds it). Off: such "
        "workers load privately.",
    )
    #: Most leases one uid holds at once, as the kernel tells the uid (on the fd channel);
    #: leases whose uid the daemon cannot know (path handles) share one such share. 0: none.
    leases_per_uid: int = setting(
        1024,
        "Most leases one uid holds (as the fd channel sees it); leases of unknown uid (path "
        "handles) share one such share (0: no limit).",
        min=0,
    )
    #: fd channel exchanges one uid holds at once (SO_PEERCRED); the channel's whole cap is 64.
    fd_connections_per_uid: int = setting(
        8, "fd channel connections one uid holds at once (0: only the channel's 64).", min=0
    )
    #: Of what the daemon may hold (--memory-budget, else its first backing's size), the
    #: fraction that sets workers' attaches loaded from one uid's files may take.
    worker_share_per_uid: float = setting(
        0.25,
        "Fraction of what engramd may hold (--memory-budget, else the shm folder's size) that "
        "sets workers' attaches load from one uid's checkpoint files may take (0: no limit).",
        min=0,
    )
    #: Seconds a set a worker's attach loaded stays held with no lease before it is dropped.
    worker_set_grace: float = setting(
        600.0,
        "Seconds a set a worker's attach loaded stays held with no lease before it is dropped "
        "(0: kept until evicted or dropped).",
        min=0,
    )
    #: Seconds a worker-socket connection may stay idle (no call in flight, or no
    #: handshake) before the daemon closes it.
    idle_timeout: float = setting(
        60.0,
        "Seconds a worker-socket connection may stay idle before it is closed.",
        min=0.001,
    )
    #: Descriptors the worker socket's connections never take: kept for the admin
    #: socket, the fd channel and the sets' files.
    fd_reserve: int = setting(
        256,
        "Open files the worker socket's connections never take (admin socket, fd channel, sets).",
        min=0,
    )
