"""The daemon's settings as a --config file gives them, judged by the type each field declares."""

from __future__ import annotations

import pytest

from engramd.config import Flag, flags, toml_value_error


def _toml_form(flag: Flag) -> object:
    """The flag's default as a TOML file writes it (a parsed value as its text)."""
    if isinstance(flag.default, bool | int | float | list):
        return flag.default
    return str(flag.default)


@pytest.mark.parametrize("flag", flags(), ids=lambda f: f.field)
def test_every_setting_takes_its_default_and_refuses_another_type_from_a_file(flag: Flag) -> None:
    """Judged from the field's declaration alone: no setting is checked case by case."""
    assert toml_value_error(flag, _toml_form(flag)) is None
    assert toml_value_error(flag, {"a": 1}) is not None
    if flag.type is bool:
        for wrong in (0, 1, "true"):
            kind = "an integer" if isinstance(wrong, int) else "text"
            assert (
                toml_value_error(flag, wrong) == f"expected true or false, got {wrong!r} ({kind})"
            )
    else:
        assert toml_value_error(flag, True) is not None


def test_numbers_sizes_and_lists_take_their_forms() -> None:
    by_field = {f.field: f for f in flags()}
    assert toml_value_error(by_field["grace"], 2) is None  # an integer is a number
    assert toml_value_error(by_field["load_threads"], 1.5) is not None
    assert toml_value_error(by_field["memory_budget"], 1 << 30) is None
    assert toml_value_error(by_field["memory_budget"], "200G") is None
    assert toml_value_error(by_field["checkpoints"], "/models/a") is None
    assert toml_value_error(by_field["checkpoints"], ["/models/a", "/models/b"]) is None
    assert "or an array of them" in str(toml_value_error(by_field["checkpoints"], [1]))
