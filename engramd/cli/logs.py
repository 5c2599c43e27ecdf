"""How the daemon and the commands log: JSON lines or escaped text, on stderr."""

from __future__ import annotations

import json
import logging
import sys

from engramd.text import escape


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class TextFormatter(logging.Formatter):
    """One line per record: control characters in a message are escaped.

    Messages quote what workers send (paths, causes); a newline in one must
    not start a forged log line.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record's line, its message escaped."""
        record.message = escape(record.message)
        return super().formatMessage(record)


def setup_logging(level: str, as_json: bool = False) -> None:
    """Log to stderr at `level`: one JSON object a line, or text lines with messages escaped."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if as_json
        else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
