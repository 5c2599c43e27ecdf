"""Options more than one command takes, and the size parser of size flags."""

from __future__ import annotations

from typing import Annotated

import typer

from engramd import units

Socket = Annotated[
    str, typer.Option("--socket", envvar="ENGRAMD_SOCKET", help="The daemon's Unix socket.")
]
AdminSocket = Annotated[
    str,
    typer.Option(
        "--admin-socket",
        envvar="ENGRAMD_ADMIN_SOCKET",
        help="The daemon's admin socket (default: admin.sock beside --socket).",
    ),
]


def parse_size(text: str) -> int:
    """Bytes from a size flag ("200G", "1.5TiB", "4096")."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
