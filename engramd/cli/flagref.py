"""docs/flags.md: the reference of `engramd serve`'s flags, written from the command itself.

The rows are read from the click command that typer builds for `serve`
(engramd/cli/serve.py, from DaemonConfig's `setting(...)` declarations in
engramd/config.py), so a flag, its variable, its --config key, its default
and its help appear here exactly as the daemon takes them. `make docs`
writes the file (`python -m engramd.cli.flagref > docs/flags.md`), and a
test fails while the file differs from what this module writes.
"""

from __future__ import annotations

from typing import Any

import typer.main

from engramd.cli.commands import app
from engramd.cli.options import FLAGS
from engramd.config import Flag, Setting, path
from engramd.units import parse_size

#: The command whose flags the reference lists.
COMMAND = "serve"

HEADER = """\
# `engramd serve` flags

<!-- Written by `make docs` (engramd/cli/flagref.py) from engramd/config.py; do not edit. -->

For operators who configure the daemon: every flag of `engramd serve`, with
the environment variable and the `--config` file key that set the same
thing. A flag wins over its variable, which wins over the file. A TOML file
given with `--config` (or `ENGRAMD_CONFIG`) takes the keys below, spelled
with `_` or `-` between words (`load_threads = 1` or `load-threads = 1`).
A repeatable flag's variable takes its values separated by spaces; an on/off
flag's variable takes `true` or `false`; a size is a number of bytes or one
with a unit (`2M`, `200G`, `1.5TiB`). What the settings mean together
(sockets, backings, huge pages, limits) is told in
[operations.md](operations.md); this page is the complete list.

| flag | variable | `--config` key | value | default | what it sets |
| --- | --- | --- | --- | --- | --- |
"""


def _serve_options() -> list[Any]:
    """The options of `engramd serve` as the command line parses them (click's Options).

    Read by their attributes: click is typer's to choose (a dependency, or
    vendored inside typer), so it is not imported here.
    """
    command = typer.main.get_command(app).commands[COMMAND]  # type: ignore[attr-defined]
    return [p for p in command.params if p.param_type_name == "option"]


def _flag_of(param: Any) -> Flag:
    """The DaemonConfig flag `param` fills, or one made for serve's own options (--log-level)."""
    for flag in FLAGS:
        if flag.field == param.name:
            return flag
    envvar = param.envvar if isinstance(param.envvar, str) else ""
    return Flag(
        param.name or "", param.opts[0], envvar, None, param.default, Setting(param.help or "")
    )


def _cell(text: str) -> str:
    """Text for a table cell: no pipes, no tags a renderer would swallow."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


#: What a value is, by the type DaemonConfig declares for it.
NOUNS: dict[Any, str] = {int: "integer", float: "number"}
#: What a value is, by the parse its setting names.
PARSED: dict[Any, str] = {parse_size: "size", path: "path"}


def _value(param: Any, flag: Flag) -> str:
    """What the flag takes: on/off, a number and its least value, a size, a path, text."""
    if param.is_flag:
        return "on/off"
    parse = flag.setting.parse
    text = PARSED.get(parse, "text") if parse is not None else NOUNS.get(flag.type, "text")
    if flag.setting.min is not None:
        text += f" >= {flag.setting.min:g}"
    return f"{text}, repeatable" if param.multiple else text


def _default(param: Any) -> str:
    value = param.default
    if param.is_flag:
        return "on" if value else "off"
    if value in (None, "", [], ()):
        return "none"
    if isinstance(value, list | tuple):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def _row(param: Any) -> str:
    flag = _flag_of(param)
    names = " / ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    # --config names the file itself: it is no key of one.
    key = "" if param.name == "config" else f"`{flag.key}`"
    env = f"`{flag.env}`" if flag.env else ""
    cells = [names, env, key, _value(param, flag), _default(param), _cell(param.help or "")]
    return "| " + " | ".join(cells) + " |"


def reference() -> str:
    """docs/flags.md's text: one row per option of `engramd serve`, in the command's order."""
    return HEADER + "".join(_row(p) + "\n" for p in _serve_options())


def main() -> None:
    """Print the reference (`python -m engramd.cli.flagref > docs/flags.md`)."""
    print(reference(), end="")


if __name__ == "__main__":
    main()
