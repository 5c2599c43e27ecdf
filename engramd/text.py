"""Text from outside the daemon, made safe to print on one line."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape(text: str) -> str:
    """`text` with control characters (newlines, escape sequences) written as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
