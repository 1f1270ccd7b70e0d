"""The vision-language tests import their helpers from here and the shared harness from ``tests/``."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).parent, Path(__file__).parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
