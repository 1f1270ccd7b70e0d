"""The vision-language tests import their helpers from here, the shared harness from ``tests/``, and (for the
generic-path recipe twin) the tiny transformers checkpoints of ``tests/hf_path``."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).parent, Path(__file__).parents[1], Path(__file__).parents[1] / "hf_path"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
