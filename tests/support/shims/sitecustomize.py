"""Run at every interpreter start of a process whose PYTHONPATH names this folder.

vLLM's model registry inspects a model class in a subprocess of its own;
the Qwen4Exp class imports torchvision, which on CPU torch needs tvshim
first (tests/support/tvshim.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tvshim  # noqa: F401
