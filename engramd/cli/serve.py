"""`engramd serve`: every flag, its ENGRAMD_* variable and its --config key, once.

Every `serve` flag can also be set through the ENGRAMD_* variable named in
its help, or as a key of the TOML file given with --config; a flag wins over
its variable, which wins over the file. This signature is the one place
where the daemon reads its environment.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer

from engramd.cli.logs import setup_logging
from engramd.cli.options import AdminSocket, Socket, parse_size
from engramd.config import BACKING_NAMES, CUDA_DEVICE_PREFIX, DaemonConfig

# Each command imports what it needs inside it: the daemon's modules (asyncio,
# gRPC's server, the backings) cost `serve` nothing it does not use, and cost
# `status`, `--help` and a daemon restart's argument parsing nothing at all.

#: The daemon's defaults: the one place they are written is DaemonConfig.
DEFAULTS = DaemonConfig()


def _backing(name: str) -> str:
    if name.startswith(CUDA_DEVICE_PREFIX):
        from engramd.backings.cuda import device_of

        try:
            device_of(name)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--backing") from None
        return name
    if name not in BACKING_NAMES:
        raise typer.BadParameter(
            f"{name!r} is not a backing (known: {', '.join(BACKING_NAMES)})",
            param_hint="--backing",
        )
    return name


def _numa(text: str) -> str:
    from engramd.host.numa import NumaError, Placement

    try:
        return Placement.parse(text).policy
    except NumaError as e:
        raise typer.BadParameter(str(e), param_hint="--numa") from None


def _apply_config_file(ctx: typer.Context, path: Path) -> dict[str, Any]:
    """ctx.params with the file's values where neither a flag nor a variable set one."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise typer.BadParameter(f"cannot read {path}: {e}", param_hint="--config") from None
    values = dict(ctx.params)
    params = {p.name: p for p in ctx.command.params if p.name}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in params or name == "config":
            known = ", ".join(sorted(n for n in params if n != "config"))
            raise typer.BadParameter(
                f"unknown key {key!r} in {path} (known: {known})", param_hint="--config"
            )
        source = ctx.get_parameter_source(name)
        if source is None or source.name == "DEFAULT":
            if getattr(params[name], "multiple", False) and isinstance(value, str):
                value = [value]
            values[name] = params[name].process_value(ctx, value)
    return values


def serve(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(envvar="ENGRAMD_CONFIG", help="TOML file with the same keys as the flags."),
    ] = None,
    checkpoint: Annotated[
        list[Path] | None,
        typer.Option(
            "--checkpoint",
            envvar="ENGRAMD_CHECKPOINT",
            help="Checkpoint folder to load at start (repeatable; ENGRAMD_CHECKPOINT takes "
            "space-separated folders).",
        ),
    ] = None,
    tensors: Annotated[
        str, typer.Option(envvar="ENGRAMD_TENSORS", help="Tensors that make a set (fnmatch).")
    ] = DEFAULTS.tensors,
    socket: Socket = DEFAULTS.socket,
    admin_socket: AdminSocket = DEFAULTS.admin_socket,
    fd_socket: Annotated[
        str,
        typer.Option(
            envvar="ENGRAMD_FD_SOCKET",
            help="The fd channel's socket (default: fds.sock beside --socket).",
        ),
    ] = DEFAULTS.fd_socket,
    socket_group: Annotated[
        str,
        typer.Option(envvar="ENGRAMD_SOCKET_GROUP", help="Group that may attach (socket, sets)."),
    ] = DEFAULTS.socket_group,
    backing: Annotated[
        str,
        typer.Option(
            envvar="ENGRAMD_BACKING",
            help=f"Where sets live: {', '.join(BACKING_NAMES)} (auto: tmpfs when the shm "
            "folder can hold the set, else memfd; cuda-device:N: GPU N's memory).",
        ),
    ] = DEFAULTS.backing,
    page_size: Annotated[
        str,
        typer.Option(
            envvar="ENGRAMD_PAGE_SIZE",
            help="memfd sets on hugetlb pages: 2M or 1G (0: the kernel's pages).",
        ),
    ] = str(DEFAULTS.page_size),
    numa: Annotated[
        str,
        typer.Option(
            envvar="ENGRAMD_NUMA",
            help="Where sets' pages go: interleave, node:N, or per-node (a copy on every node, "
            "each worker mapping its node's; default: the kernel's choice).",
        ),
    ] = DEFAULTS.numa,
    shm_dir: Annotated[
        Path,
        typer.Option(
            envvar="ENGRAMD_SHM_DIR", help="tmpfs or hugetlbfs folder for the sets (detected)."
        ),
    ] = Path(DEFAULTS.shm_dir),
    allow_disk_backed_tables: Annotated[
        bool,
        typer.Option(
            envvar="ENGRAMD_ALLOW_DISK_BACKED_TABLES",
            help="Accept a --shm-dir that is not tmpfs or hugetlbfs: the tables are written to "
            "disk and served from the page cache, which the kernel may evict.",
        ),
    ] = DEFAULTS.allow_disk_backed_tables,
    huge_tmpfs: Annotated[
        bool,
        typer.Option(
            envvar="ENGRAMD_HUGE_TMPFS",
            help="Mount a tmpfs with 2 MiB pages (huge=within_size) over <shm-dir>/engramd where "
            "engramd may (CAP_SYS_ADMIN, the host's mount namespace) and the folder holds no sets.",
        ),
    ] = DEFAULTS.huge_tmpfs,
    allow_root: Annotated[
        list[Path] | None,
        typer.Option(
            "--allow-root",
            envvar="ENGRAMD_ALLOW_ROOT",
            help="Folder under which a worker's attach may start a load (repeatable).",
        ),
    ] = None,
    memory_budget: Annotated[
        str,
        typer.Option(envvar="ENGRAMD_MEMORY_BUDGET", help="Most bytes of sets held (0: no limit)."),
    ] = str(DEFAULTS.memory_budget),
    evict_idle: Annotated[
        bool,
        typer.Option(
            envvar="ENGRAMD_EVICT_IDLE",
            help="Drop unleased sets, oldest first, to stay within the budget.",
        ),
    ] = DEFAULTS.evict_idle,
    verify: Annotated[
        bool,
        typer.Option(envvar="ENGRAMD_VERIFY", help="Recompute checksums of adopted sets."),
    ] = DEFAULTS.verify,
    drop_on_exit: Annotated[
        bool, typer.Option(envvar="ENGRAMD_DROP_ON_EXIT", help="Remove the sets at shutdown.")
    ] = DEFAULTS.drop_on_exit,
    mlock: Annotated[
        bool, typer.Option(envvar="ENGRAMD_MLOCK", help="Lock the sets' pages in memory.")
    ] = DEFAULTS.mlock,
    load_threads: Annotated[
        int,
        typer.Option(envvar="ENGRAMD_LOAD_THREADS", min=1, help="Threads that copy a set."),
    ] = DEFAULTS.load_threads,
    health_port: Annotated[
        int, typer.Option(envvar="ENGRAMD_HEALTH_PORT", help="TCP port for gRPC health (0: off).")
    ] = DEFAULTS.health_port,
    health_address: Annotated[
        str, typer.Option(envvar="ENGRAMD_HEALTH_ADDRESS", help="Address of the health port.")
    ] = DEFAULTS.health_address,
    metrics_port: Annotated[
        int, typer.Option(envvar="ENGRAMD_METRICS_PORT", help="TCP port for metrics (0: off).")
    ] = DEFAULTS.metrics_port,
    metrics_address: Annotated[
        str, typer.Option(envvar="ENGRAMD_METRICS_ADDRESS", help="Address of the metrics port.")
    ] = DEFAULTS.metrics_address,
    grace: Annotated[
        float,
        typer.Option(
            envvar="ENGRAMD_GRACE", help="Seconds in-flight calls get at shutdown (SIGTERM)."
        ),
    ] = DEFAULTS.grace_s,
    sweep_interval: Annotated[
        float,
        typer.Option(
            envvar="ENGRAMD_SWEEP_INTERVAL",
            help="Seconds between sweeps for leases of exited workers.",
        ),
    ] = DEFAULTS.sweep_interval_s,
    adopt_grace: Annotated[
        float,
        typer.Option(
            envvar="ENGRAMD_ADOPT_GRACE",
            help="Seconds an adopted set is kept from eviction while its workers re-attach.",
        ),
    ] = DEFAULTS.adopt_grace_s,
    max_leases: Annotated[
        int,
        typer.Option(
            envvar="ENGRAMD_MAX_LEASES", min=0, help="Most leases held at once (0: no limit)."
        ),
    ] = DEFAULTS.max_leases,
    allow_writable_gpu_mappings: Annotated[
        bool,
        typer.Option(
            envvar="ENGRAMD_ALLOW_WRITABLE_GPU_MAPPINGS",
            help="Hand writable descriptors of tmpfs sets to workers that say their GPU "
            "cannot register read-only memory: any member of the socket group may say so, "
            "and could then change the one copy every worker reads (engramd verify finds "
            "it). Off: such workers load privately.",
        ),
    ] = DEFAULTS.allow_writable_gpu_mappings,
    leases_per_uid: Annotated[
        int,
        typer.Option(
            envvar="ENGRAMD_LEASES_PER_UID",
            min=0,
            help="Most leases one uid holds (as the fd channel sees it); leases of unknown "
            "uid (path handles) share one such share (0: no limit).",
        ),
    ] = DEFAULTS.leases_per_uid,
    fd_connections_per_uid: Annotated[
        int,
        typer.Option(
            envvar="ENGRAMD_FD_CONNECTIONS_PER_UID",
            min=0,
            help="fd channel connections one uid holds at once (0: only the channel's 64).",
        ),
    ] = DEFAULTS.fd_connections_per_uid,
    idle_timeout: Annotated[
        float,
        typer.Option(
            envvar="ENGRAMD_IDLE_TIMEOUT",
            min=0.001,
            help="Seconds a worker-socket connection may stay idle before it is closed.",
        ),
    ] = DEFAULTS.idle_timeout_s,
    fd_reserve: Annotated[
        int,
        typer.Option(
            envvar="ENGRAMD_FD_RESERVE",
            min=0,
            help="Open files the worker socket's connections never take (admin socket, "
            "fd channel, sets).",
        ),
    ] = DEFAULTS.fd_reserve,
    log_level: Annotated[str, typer.Option(envvar="ENGRAMD_LOG_LEVEL")] = "info",
    log_json: Annotated[
        bool, typer.Option(envvar="ENGRAMD_LOG_JSON", help="One JSON object per log line.")
    ] = False,
) -> None:
    """Run the daemon: load the tables into shared memory once, serve handles to workers."""
    import asyncio

    from engramd.api.server import serve as run

    values = _apply_config_file(ctx, config) if config else dict(ctx.params)
    setup_logging(values["log_level"], values["log_json"])
    daemon_config = DaemonConfig(
        checkpoints=[str(p) for p in values["checkpoint"] or []],
        tensors=values["tensors"],
        socket=values["socket"],
        admin_socket=values["admin_socket"],
        fd_socket=values["fd_socket"],
        socket_group=values["socket_group"],
        backing=_backing(values["backing"]),
        page_size=parse_size(str(values["page_size"])),
        numa=_numa(values["numa"]),
        shm_dir=str(values["shm_dir"]),
        allow_disk_backed_tables=values["allow_disk_backed_tables"],
        huge_tmpfs=values["huge_tmpfs"],
        allow_roots=[str(p) for p in values["allow_root"] or []],
        memory_budget=parse_size(str(values["memory_budget"])),
        evict_idle=values["evict_idle"],
        verify=values["verify"],
        drop_on_exit=values["drop_on_exit"],
        mlock=values["mlock"],
        load_threads=values["load_threads"],
        health_port=values["health_port"],
        health_address=values["health_address"],
        metrics_port=values["metrics_port"],
        metrics_address=values["metrics_address"],
        grace_s=values["grace"],
        sweep_interval_s=values["sweep_interval"],
        adopt_grace_s=values["adopt_grace"],
        max_leases=values["max_leases"],
        allow_writable_gpu_mappings=values["allow_writable_gpu_mappings"],
        leases_per_uid=values["leases_per_uid"],
        fd_connections_per_uid=values["fd_connections_per_uid"],
        idle_timeout_s=values["idle_timeout"],
        fd_reserve=values["fd_reserve"],
    )
    try:
        asyncio.run(run(daemon_config))
    except (RuntimeError, ValueError, OSError) as e:
        logging.getLogger("engramd").error("%s", e)
        raise typer.Exit(1) from None
