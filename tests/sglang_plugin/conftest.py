"""The SGLang plugin's fixtures (sglang_harness.py, ple_harness.py)."""

import tvshim  # noqa: F401 (before anything imports sglang)
from sglang_plugin.ple_harness import ple_disk, ple_model
from sglang_plugin.sglang_harness import model, served, stored

__all__ = ["model", "ple_disk", "ple_model", "served", "stored"]
