"""`engramd serve`: its options, built from DaemonConfig's declarations, and the daemon's start.

Every field of DaemonConfig is a `serve` flag (engramd/config.py declares
its name, variable and help); it can also be set through its ENGRAMD_*
variable, or as a key of the TOML file given with --config; a flag wins
over its variable, which wins over the file. This command is the one place
where the daemon reads its environment.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from engramd.cli.logs import setup_logging
from engramd.cli.options import FLAGS, default, option, read_config
from engramd.config import DaemonConfig, Flag, Setting, toml_value_error

#: Every key a --config file may hold, as its flag: DaemonConfig's, and serve's own options
#: (--log-level, --log-json) typed as `serve` declares them.
FIELDS: dict[str, Flag] = {f.field: f for f in FLAGS} | {
    name: Flag(name, "--" + name.replace("_", "-"), "", kind, None, Setting(""))
    for name, kind in (("log_level", str), ("log_json", bool))
}


# Each command imports what it needs inside it: the daemon's modules (asyncio,
# gRPC's server, the backings) cost `serve` nothing it does not use, and cost
# `status`, `--help` and a daemon restart's argument parsing nothing at all.


def _read_config_file(ctx: typer.Context, path: Path | None) -> Path | None:
    """The file's values as the defaults of the flags, below flags and variables."""
    if path is None:
        return None
    doc = read_config(path)
    # A key is a flag's name; the value goes to the parameter the flag fills.
    params = {
        p.opts[0].removeprefix("--").replace("-", "_"): p
        for p in ctx.command.params
        if p.param_type_name == "option" and p.name != "config"
    }
    values: dict[str, Any] = {}
    for key, value in doc.items():
        param = params.get(key.replace("-", "_"))
        if param is None or param.name is None:
            raise typer.BadParameter(
                f"unknown key {key!r} in {path} (known: {', '.join(sorted(params))})",
                param_hint="--config",
            )
        wrong = toml_value_error(FIELDS[param.name], value)
        if wrong is not None:
            raise typer.BadParameter(f"key {key!r} in {path}: {wrong}", param_hint="--config")
        multiple = getattr(param, "multiple", False)
        value = [value] if multiple and isinstance(value, str) else value
        try:
            # Judged here, so that a bad value names the file and key, not the flag.
            param.type_cast_value(ctx, value)
        except typer.BadParameter as e:
            raise typer.BadParameter(
                f"key {key!r} in {path}: {e.message}", param_hint="--config"
            ) from None
        values[param.name] = value
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def serve(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            envvar="ENGRAMD_CONFIG",
            is_eager=True,
            callback=_read_config_file,
            help="TOML file with the same keys as the flags.",
        ),
    ] = None,
    log_level: Annotated[
        str,
        typer.Option(envvar="ENGRAMD_LOG_LEVEL", help="debug, info, warning or error."),
    ] = "info",
    log_json: Annotated[
        bool, typer.Option(envvar="ENGRAMD_LOG_JSON", help="One JSON object per log line.")
    ] = False,
    **settings: Any,
) -> None:
    """Run the daemon: load the tables into shared memory once, serve handles to workers."""
    import asyncio
    import faulthandler

    from engramd.lifecycle import serve as run

    setup_logging(log_level, log_json)
    # A fault in a native library (gRPC's core, a transfer library) kills the daemon without a
    # Python traceback; every thread's stack in its log is what an operator can report.
    faulthandler.enable()
    try:
        asyncio.run(run(DaemonConfig(**settings)))
    except (RuntimeError, ValueError, OSError) as e:
        logging.getLogger("engramd").error("%s", e)
        raise typer.Exit(1) from None


def _signature() -> inspect.Signature:
    """serve's parameters with one keyword per DaemonConfig field, where typer reads them."""
    ctx, config, *logs, _ = inspect.signature(serve, eval_str=True).parameters.values()
    fields = [
        inspect.Parameter(
            f.field, inspect.Parameter.KEYWORD_ONLY, default=default(f), annotation=option(f)
        )
        for f in FLAGS
    ]
    logs = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in logs]
    return inspect.Signature([ctx, config, *fields, *logs], return_annotation=None)


serve.__signature__ = _signature()  # type: ignore[attr-defined]
