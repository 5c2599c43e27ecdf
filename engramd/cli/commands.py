"""The `engramd` command: serve (serve.py), status, load, drop, verify, manifest, synth, demo."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from engramd import __version__
from engramd.cli.logs import setup_logging
from engramd.cli.options import AdminSocket, ConfigFile, Socket
from engramd.cli.serve import serve
from engramd.config import admin_socket_for
from engramd_shared.checkpoint import DEFAULT_TENSORS, is_store_url
from engramd_shared.config import DEFAULT_SOCKET
from engramd_shared.families import ENGRAM

if TYPE_CHECKING:
    import grpc

# Each command imports what it needs inside it: the daemon's modules (asyncio,
# gRPC's server, the backings) cost `serve` nothing it does not use, and cost
# `status`, `--help` and a daemon restart's argument parsing nothing at all.

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # click's own help: at 80 columns rich's option tables cut flags and variable names short.
    rich_markup_mode=None,
    # As wide as the terminal (click stops at 80 by default).
    context_settings={"max_content_width": 1000},
    help="One copy of the Engram tables per node, shared by every worker.",
)
app.command()(serve)


def _columns() -> int:
    """The terminal's width for status tables; 0 (as wide as needed) when not a terminal."""
    import shutil

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 0


def _unanswered(socket: str, e: grpc.RpcError) -> typer.Exit:
    from engramd.cli.reach import unanswered

    typer.echo(unanswered(socket, str(e.details())), err=True)
    return typer.Exit(1)


def _worker_side(command: str) -> None:
    """Exit 1 naming what to install when `command`, which builds torch tensors as a worker
    does, runs where only the daemon is installed (engramd-node brings no torch)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        typer.echo(
            f"engramd {command} needs torch, which the daemon alone does not install: "
            "pip install 'engramd-node[client]' (torch's CPU build is enough)",
            err=True,
        )
        raise typer.Exit(1)


@app.command()
def status(
    config: ConfigFile = None,
    socket: Socket = DEFAULT_SOCKET,
    admin_socket: AdminSocket = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh in place until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
) -> None:
    """Show what the node holds: shm folder, sets, leases, memory saved.

    Asked on the admin socket where this user may open it (it answers while
    idle connections fill the worker socket), else on the worker socket.
    Exits 1 when no daemon answers, 2 while it is not ready (loading, or a
    configured checkpoint failed: shown with its error).
    """
    if watch:
        # Ctrl-C is taken between frames only: a signal that lands inside
        # gRPC's channel machinery (even one a Python handler merely records)
        # can hang the process. Blocked before any import or channel, so every
        # thread inherits the mask and SIGINT stays pending until sigtimedwait
        # takes it; a thread started earlier would take it as KeyboardInterrupt.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    import grpc

    from engramd.cli.status_view import as_dict, fetch, render

    admin = admin_socket or admin_socket_for(socket)
    if not watch:
        try:
            reply = fetch(socket, admin)
        except grpc.RpcError as e:
            raise _unanswered(socket, e) from None
        typer.echo(json.dumps(as_dict(reply), indent=2) if as_json else render(reply, _columns()))
        if not reply.daemon.ready:
            raise typer.Exit(2)
        return
    while True:
        try:
            text = render(fetch(socket, admin), _columns())
        except grpc.RpcError as e:
            from engramd.cli.reach import unanswered

            text = unanswered(socket, str(e.details()))
        # Home the cursor and clear, so the table redraws in place (written
        # directly: typer.echo strips escape codes when not on a terminal).
        sys.stdout.write(f"\033[H\033[2J{time.strftime('%H:%M:%S')}  {text}\n")
        sys.stdout.flush()
        if signal.sigtimedwait({signal.SIGINT}, interval) is not None:
            return


def _admin(socket: str, admin_socket: str) -> tuple[Any, str]:
    from engramd_shared.channel import open_channel
    from engramd_shared.config import ClientConfig
    from engramd_shared.pb import engramd_pb2_grpc as pb_grpc

    path = admin_socket or admin_socket_for(socket)
    _check_admin_access(path)
    channel = open_channel(ClientConfig(socket=path))
    return pb_grpc.AdminServiceStub(channel), path


def _check_admin_access(path: str) -> None:
    """Exit naming the fix when this user may not open the admin socket (0600, the daemon's)."""
    import os
    import pwd

    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return  # gRPC's "not answering" names the path
    except PermissionError:
        typer.echo(
            f"cannot reach the admin socket {path}: its folder is closed to this user; load, "
            "drop and verify are for engramd's own user (run the command as that user, or as "
            "root)",
            err=True,
        )
        raise typer.Exit(1) from None
    if not os.access(path, os.R_OK | os.W_OK):
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = str(st.st_uid)
        typer.echo(
            f"cannot open the admin socket {path}: it is {owner}'s only (0600); load, drop and "
            f"verify are for engramd's own user: run the command as {owner} "
            f"(sudo -u {owner} engramd ...) or as root",
            err=True,
        )
        raise typer.Exit(1)


@app.command()
def load(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="Checkpoint folder, as the daemon sees it, or s3://bucket/prefix (the daemon "
            "fills it from its peers and that store)."
        ),
    ],
    tensors: str = DEFAULT_TENSORS,
    replaces: Annotated[
        str,
        typer.Option(
            help="The id of a published set this checkpoint's set replaces as its next "
            "generation (same tensors and shapes): running engines move to it at a step "
            "boundary. Needed only for another folder than that set's: a load of the same "
            "folder whose files changed replaces it without it."
        ),
    ] = "",
    config: ConfigFile = None,
    socket: Socket = DEFAULT_SOCKET,
    admin_socket: AdminSocket = "",
) -> None:
    """Load a checkpoint's tables into the daemon, with a progress bar."""
    import grpc

    from engramd.cli.load_view import load_bar
    from engramd.units import gib
    from engramd_shared.pb import engramd_pb2 as pb

    stub, _ = _admin(socket, admin_socket)
    progress = load_bar()
    task = None
    try:
        for event in stub.Load(
            pb.LoadRequest(
                # A folder as this shell names it; the daemon's working folder is another.
                checkpoint=checkpoint
                if is_store_url(checkpoint)
                else str(Path(checkpoint).resolve()),
                tensors=tensors,
                replaces=replaces,
            )
        ):
            if task is None:
                # Drawn from the first event on: a load refused at once prints its error only.
                progress.start()
                task = progress.add_task("load")
            if event.WhichOneof("event") == "progress":
                p = event.progress
                progress.update(task, completed=p.bytes_done, total=p.bytes_total)
            else:
                s = event.ready
                progress.update(task, completed=s.bytes, total=s.bytes)
                progress.stop()
                typer.echo(f"set {s.set_id} ready: {gib(s.bytes)}, {s.tensors} tensors")
                if s.generation > 1:
                    typer.echo(
                        f"generation {s.generation}: running engines move to it at their next "
                        "step; `engramd status` shows which are on which generation"
                    )
    except grpc.RpcError as e:
        progress.stop()
        typer.echo(f"load failed: {e.details()}", err=True)
        raise typer.Exit(1) from None
    finally:
        progress.stop()


@app.command()
def drop(
    set_id: str,
    force: Annotated[bool, typer.Option(help="Drop even while workers hold leases.")] = False,
    config: ConfigFile = None,
    socket: Socket = DEFAULT_SOCKET,
    admin_socket: AdminSocket = "",
) -> None:
    """Remove a set from shared memory (workers that map it keep their mapping)."""
    import grpc

    from engramd.units import gib
    from engramd_shared.pb import engramd_pb2 as pb

    stub, _ = _admin(socket, admin_socket)
    try:
        reply = stub.Drop(pb.DropRequest(set_id=set_id, force=force), timeout=30)
    except grpc.RpcError as e:
        typer.echo(f"drop failed: {e.details()}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"dropped set {set_id}: {gib(reply.bytes)}, {reply.leases} leases ended")


@app.command()
def verify(
    set_id: str,
    config: ConfigFile = None,
    socket: Socket = DEFAULT_SOCKET,
    admin_socket: AdminSocket = "",
) -> None:
    """Recompute a set's checksums; name every tensor that no longer matches (exit 1).

    A copy with changed bytes is then served no more: new attaches are refused,
    its workers are told it is stale, until `engramd load` loads it again.
    """
    import grpc

    from engramd.units import gib
    from engramd_shared.pb import engramd_pb2 as pb

    stub, _ = _admin(socket, admin_socket)
    try:
        reply = stub.Verify(pb.VerifyRequest(set_id=set_id))
    except grpc.RpcError as e:
        typer.echo(f"verify failed: {e.details()}", err=True)
        raise typer.Exit(1) from None
    if reply.corrupted:
        for name in reply.corrupted:
            typer.echo(f"corrupted: {name}")
        # No fix: a daemon older than the field, which kept serving the copy.
        served = (
            f"engramd hands out that copy no more; leases told it is stale: "
            f"{reply.stale_leases}; {reply.fix}"
            if reply.fix
            else "drop the set and load it again"
        )
        typer.echo(
            f"set {set_id}: {len(reply.corrupted)} of {reply.tensors} tensors differ "
            f"from their checksums; {served}",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(f"set {set_id}: all {reply.tensors} tensors match ({gib(reply.bytes)})")


@app.command()
def manifest(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint folder (the bucket's files).")],
    peer_token_file: Annotated[
        str, typer.Option(help="File holding the fleet's token (as serve's).")
    ],
    tensors: str = DEFAULT_TENSORS,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Where to write it (default: its key's name, here)."),
    ] = None,
) -> None:
    """Write the attested manifest an object-store fill needs beside the checkpoint's files.

    Reads every selected byte of the checkpoint once (as a load does), takes
    each tensor's XXH3 checksum and strong digest (BLAKE3 of its 16 MiB
    pieces, on every core) and attests them with the fleet's key; upload the
    file under the bucket's prefix with the name printed.
    """
    from engramd.fleet.trust import FleetKey, attest_checkpoint, manifest_key, read_token
    from engramd_shared.checkpoint import plan_tables
    from engramd_shared.errors import CheckpointError

    try:
        key = FleetKey(read_token(peer_token_file))
        plan = plan_tables(checkpoint.resolve(), tensors)
        attested = attest_checkpoint(plan, key)
    except (ValueError, CheckpointError) as e:
        typer.echo(f"manifest failed: {e}", err=True)
        raise typer.Exit(1) from None
    name = manifest_key("", plan.set_id)
    path = output or Path(name)
    path.write_bytes(attested.to_bytes())
    typer.echo(
        f"set {plan.set_id}: {len(plan.tensors)} tensors attested in {path}; upload it as "
        f"s3://BUCKET/PREFIX/{name} beside the checkpoint's files"
    )


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Folder to write the checkpoint into.")],
    family: Annotated[
        Literal["engram", "ple"],
        typer.Option(
            help="engram: DeepSeek-V4.1's Engram tables (fp8, e8m0 scales); ple: Qwen4Exp's "
            "PLE n-gram tables in row shards."
        ),
    ] = "engram",
    layers: Annotated[int, typer.Option(help="Layers that carry a table.")] = 2,
    rows: Annotated[int, typer.Option(help="Rows per table.")] = 1_000_000,
    dim: Annotated[
        int | None, typer.Option(help="Values per row (default: 256 engram, 64 ple).")
    ] = None,
    shards: Annotated[int, typer.Option(help="Files the checkpoint is spread over.")] = 2,
    parts: Annotated[
        int | None, typer.Option(help="ple: row shards per table (shard_N) (default: 7).")
    ] = None,
    table_format: Annotated[
        str | None,
        typer.Option(
            "--format", help="ple: the tables' format, BF16, F8_E4M3 or NVFP4 (default: BF16)."
        ),
    ] = None,
    seed: int = 0,
) -> None:
    """Write a synthetic checkpoint with safetensors whose every table byte can be recomputed:
    Engram tables, or Qwen4Exp's PLE n-gram tables (--family ple). Needs torch ([client])."""
    _worker_side("synth")
    from engramd.testing.synth import (
        NVFP4_BLOCK,
        PLE_FORMATS,
        PleSpec,
        SynthSpec,
        synthesize,
        synthesize_ple,
    )

    if family == ENGRAM.name:
        for flag, value in (("--parts", parts), ("--format", table_format)):
            if value is not None:
                raise typer.BadParameter("applies to --family ple only", param_hint=flag)
        spec = SynthSpec(layers=layers, rows=rows, shards=shards, seed=seed)
        if dim is not None:
            spec = dataclasses.replace(spec, dim=dim)
        synthesize(out, spec)
        what = f"{layers} Engram layers"
        nbytes = spec.table_bytes
    else:
        # Every other decoder layer from 0 carries a table, as in the tests' checkpoints.
        ple = PleSpec(layers=tuple(range(0, 2 * layers, 2)), rows=rows, files=shards, seed=seed)
        ple = dataclasses.replace(
            ple,
            dim=ple.dim if dim is None else dim,
            parts=ple.parts if parts is None else parts,
            fmt=table_format or ple.fmt,
        )
        if ple.fmt not in PLE_FORMATS:
            raise typer.BadParameter(
                f"{ple.fmt!r} is not one of {', '.join(PLE_FORMATS)}", param_hint="--format"
            )
        if ple.fmt == "NVFP4" and ple.dim % NVFP4_BLOCK:
            raise typer.BadParameter(
                f"NVFP4 takes a multiple of {NVFP4_BLOCK} values per row", param_hint="--dim"
            )
        synthesize_ple(out, ple)
        what = f"{layers} Qwen4Exp PLE layers ({ple.fmt}, {ple.parts} row shards each)"
        nbytes = ple.table_bytes
    typer.echo(f"wrote {out}: {what}, {nbytes / 2**30:.2f} GiB of tables")


@app.command()
def demo(
    rows: Annotated[
        int, typer.Option(help="Rows per Engram table (default: about 1 GiB).")
    ] = 2_000_000,
    replicas: int = 4,
    steps: Annotated[int, typer.Option(help="Lookup steps per replica.")] = 20,
    tokens: Annotated[int, typer.Option(help="Tokens per step.")] = 4096,
    workdir: Annotated[Path | None, typer.Option(help="Where to write the checkpoint.")] = None,
) -> None:
    """Show the point in one command: N replicas share one copy; one private for comparison.
    Its replicas are workers: needs torch ([client])."""
    _worker_side("demo")
    from engramd.demo.run import run_demo

    setup_logging("warning")
    raise typer.Exit(
        run_demo(rows=rows, replicas=replicas, steps=steps, tokens=tokens, workdir=workdir)
    )


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    """Console-script entry point."""
    app()
