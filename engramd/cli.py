"""The `engramd` command: serve, status, synth, demo.

Every `serve` flag can also be set through the ENGRAMD_* variable named in
its help; this signature is the one place where the daemon reads them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import grpc
import typer

from engramd_client.checkpoint import DEFAULT_TENSORS
from engramd_client.config import DEFAULT_SOCKET

from . import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="One copy of the Engram tables per node, shared by every worker.",
)

Socket = Annotated[
    str, typer.Option("--socket", envvar="ENGRAMD_SOCKET", help="The daemon's Unix socket.")
]


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def serve(
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
    ] = DEFAULT_TENSORS,
    socket: Socket = DEFAULT_SOCKET,
    shm_dir: Annotated[
        Path, typer.Option(envvar="ENGRAMD_SHM_DIR", help="tmpfs folder for the sets.")
    ] = Path("/dev/shm"),
    allow_root: Annotated[
        list[Path] | None,
        typer.Option(
            "--allow-root",
            envvar="ENGRAMD_ALLOW_ROOT",
            help="Folder under which a worker's attach may start a load (repeatable).",
        ),
    ] = None,
    drop_on_exit: Annotated[
        bool,
        typer.Option(envvar="ENGRAMD_DROP_ON_EXIT", help="Remove the sets from tmpfs at shutdown."),
    ] = False,
    mlock: Annotated[
        bool, typer.Option(envvar="ENGRAMD_MLOCK", help="Lock the sets' pages in memory.")
    ] = True,
    load_threads: Annotated[
        int,
        typer.Option(
            envvar="ENGRAMD_LOAD_THREADS", min=1, help="Threads that copy a set into tmpfs."
        ),
    ] = 2,
    log_level: Annotated[str, typer.Option(envvar="ENGRAMD_LOG_LEVEL")] = "info",
) -> None:
    """Run the daemon: load the tables into shared memory once, serve handles to workers."""
    from .config import DaemonConfig
    from .server import serve as run

    _logging(log_level)
    config = DaemonConfig(
        checkpoints=[str(p) for p in checkpoint or []],
        tensors=tensors,
        socket=socket,
        shm_dir=str(shm_dir),
        allow_roots=[str(p) for p in allow_root or []],
        drop_on_exit=drop_on_exit,
        mlock=mlock,
        load_threads=load_threads,
    )
    try:
        asyncio.run(run(config))
    except (RuntimeError, ValueError, OSError) as e:
        logging.getLogger("engramd").error("%s", e)
        raise typer.Exit(1) from None


@app.command()
def status(
    socket: Socket = DEFAULT_SOCKET,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Show what the node holds: shm folder, sets, leases, memory saved."""
    from .status_view import as_dict, fetch, render

    try:
        reply = fetch(socket)
    except grpc.RpcError as e:
        typer.echo(f"engramd is not answering on {socket}: {e.details()}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(as_dict(reply), indent=2) if as_json else render(reply))


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Folder to write the checkpoint into.")],
    layers: int = 2,
    rows: Annotated[int, typer.Option(help="Rows per Engram table.")] = 1_000_000,
    dim: int = 256,
    shards: int = 2,
    seed: int = 0,
) -> None:
    """Write a synthetic Engram checkpoint (fp8 tables with e8m0 scales) with safetensors."""
    from .synth import SynthSpec, synthesize

    spec = SynthSpec(layers=layers, rows=rows, dim=dim, shards=shards, seed=seed)
    synthesize(out, spec)
    typer.echo(f"wrote {out}: {layers} Engram layers, {spec.table_bytes / 2**30:.2f} GiB of tables")


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
    """Show the point in one command: N replicas share one copy; one private for comparison."""
    from .demo import run_demo

    _logging("warning")
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
