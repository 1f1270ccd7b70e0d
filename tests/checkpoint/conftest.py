"""The checkpoint tests import the shared harness from ``tests/``, the tiny hub models from ``tests/models/`` and
their worker module from here."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).parent, Path(__file__).parents[1], Path(__file__).parents[1] / "models"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
