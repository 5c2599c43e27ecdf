"""A daemon setting as a typer option, and the options more than one command takes."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from engramd.config import Flag, flags

#: The daemon's flags, in DaemonConfig's order (read once: `serve` builds on them too).
FLAGS = flags()
_BY_FIELD = {f.field: f for f in FLAGS}


def option(flag: Flag) -> Any:
    """The annotation typer reads for `flag`: its name, variable, help, and its parse.

    A value is parsed once, here (command line, variable or --config file);
    typer turns a parse's ValueError into a BadParameter naming the flag.
    """
    parse = flag.setting.parse
    # A switch's off side too: --mlock/--no-mlock.
    name = f"{flag.option}/--no-{flag.option[2:]}" if flag.type is bool else flag.option
    return Annotated[
        flag.type,
        typer.Option(
            name,
            envvar=flag.env,
            help=flag.setting.help,
            min=flag.setting.min,
            parser=None if parse is None else _parser(flag.option, parse),
            metavar=None if parse is None else "<text>",
        ),
    ]


def _parser(name: str, parse: Callable[[str], Any]) -> Callable[[object], Any]:
    def parsed(value: object) -> Any:
        try:
            # A --config file may give a size as a number.
            return parse(str(value))
        except ValueError as e:
            # typer's own message would drop the reason.
            raise typer.BadParameter(str(e), param_hint=name) from None

    return parsed


def default(flag: Flag) -> Any:
    """The option's default; text for a parsed value, which typer parses like a flag's."""
    parsed = flag.setting.parse and not isinstance(flag.default, list)
    return str(flag.default) if parsed else flag.default


def _shared(field: str) -> Any:
    flag = _BY_FIELD[field]
    return typer.Option(flag.option, envvar=flag.env, help=flag.setting.help)


Socket = Annotated[str, _shared("socket")]
AdminSocket = Annotated[str, _shared("admin_socket")]


#: The daemon's settings that the client commands read from its --config file.
_CLIENT_KEYS = ("socket", "admin_socket")


def read_config(path: Path) -> dict[str, Any]:
    """The TOML file `--config` names; an unreadable one is the flag's error."""
    try:
        text = path.read_text()
    except OSError as e:
        raise typer.BadParameter(f"cannot read {path}: {e}", param_hint="--config") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise typer.BadParameter(toml_syntax(path, text, str(e)), param_hint="--config") from None


#: tomllib's words for what is wrong, and what the file should say instead.
_TOML_HINTS = {
    "Invalid value": (
        "a value must be true or false, a number, or text in quotes "
        '(socket = "/run/engramd/engramd.sock", checkpoint = ["/models/a"])'
    ),
    "Expected '=' after a key": "each line is key = value (load_threads = 4); text goes in quotes",
    "Cannot overwrite a value": "a key is given twice: keep one",
    "Invalid statement": "each line is key = value; a comment starts with #",
}


def toml_syntax(path: Path, text: str, error: str) -> str:
    """A TOML syntax error as the operator can fix it: what, where, the line, the rule."""
    where = re.search(r"\(at line (\d+), column (\d+)\)", error)
    what = error[: where.start()].strip() if where else error
    message = f"{path} is not valid TOML: {what}"
    if where:
        line, column = int(where[1]), int(where[2])
        lines = text.splitlines()
        shown = lines[line - 1] if 0 < line <= len(lines) else ""
        message += f" at line {line}, column {column}: {shown.strip()!r}"
    hint = next((h for start, h in _TOML_HINTS.items() if what.startswith(start)), "")
    return f"{message}; {hint}" if hint else message


def _client_config(ctx: typer.Context, path: Path | None) -> Path | None:
    """The daemon's socket paths from its TOML file, below the flags and their variables.

    The file is the one `engramd serve --config` reads; its other keys are the daemon's.
    """
    if path is None:
        return None
    doc = read_config(path)
    values = {}
    for key, value in doc.items():
        field = key.replace("-", "_")
        if field in _CLIENT_KEYS:
            if not isinstance(value, str):
                raise typer.BadParameter(
                    f"key {key!r} in {path} must be a path in quotes, not {value!r}",
                    param_hint="--config",
                )
            values[field] = value
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


#: --config for the client commands: where the daemon's sockets are, read from its file.
ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="ENGRAMD_CONFIG",
        is_eager=True,
        callback=_client_config,
        help="The daemon's TOML file (engramd serve --config): its socket paths are used.",
    ),
]
