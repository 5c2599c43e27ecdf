"""When a load's progress lines are logged: not in its first second, then every 10% or 5 s."""

from __future__ import annotations

import logging
import time

import pytest

from engramd.sets.loader import PROGRESS_EVERY_S, PROGRESS_QUIET_S, LoadProgress

MiB = 1 << 20


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    said = [r.getMessage() for r in caplog.records if r.name == "engramd"]
    caplog.clear()
    return said


def test_a_load_done_within_its_first_second_logs_no_progress_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "engramd")
    p = LoadProgress(100 * MiB, "s1")
    for _ in range(100):
        p.add(MiB)
    assert lines(caplog) == []


def test_lines_every_ten_percent_or_five_seconds_naming_the_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "engramd")
    p = LoadProgress(100 * MiB, "s1")
    p.started -= PROGRESS_QUIET_S
    p.add(10 * MiB)
    [line] = lines(caplog)
    assert line.startswith("set s1: 10.00 MiB of 100.00 MiB (10%) from files, ")
    assert line.endswith(" s left") and " GB/s, " in line
    p.add(9 * MiB)
    assert lines(caplog) == []
    p.add(MiB)
    assert [m.split(" (")[0] for m in lines(caplog)] == ["set s1: 20.00 MiB of 100.00 MiB"]
    # A slow stretch: a line once five seconds passed, however little came in.
    p.restart("peer 10.0.0.1:7077")
    p.started = time.monotonic() - PROGRESS_EVERY_S
    p.add(MiB)
    [line] = lines(caplog)
    assert line.startswith("set s1: 1.00 MiB of 100.00 MiB (1%) from peer 10.0.0.1:7077, ")
    # The last bytes log nothing: the ready line says it.
    p.add(99 * MiB)
    assert lines(caplog) == []


def test_an_unnamed_progress_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "engramd")
    p = LoadProgress(100 * MiB)
    p.started -= 10 * PROGRESS_EVERY_S
    p.add(50 * MiB)
    assert lines(caplog) == []
