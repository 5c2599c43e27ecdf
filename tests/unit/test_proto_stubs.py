"""The committed protobuf stubs are what `make proto` writes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_text() for p in gen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in gen.OUT.iterdir() if p.is_file()}
    assert sorted(committed) == sorted(fresh), "stub files differ; run `make proto`"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale; run `make proto` and commit it"
