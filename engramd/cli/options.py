"""A daemon setting as a typer option, and the options more than one command takes."""

from __future__ import annotations

from collections.abc import Callable
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
