"""The generic-path tests import the shared harness from ``tests/``, their helpers from here and the pipeline
tests' from ``tests/parallel/``."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).parent, Path(__file__).parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
# the pipeline tests' fit and comparison (parallel/pipeline_cases.py), after this folder's own helpers
if str(Path(__file__).parents[1] / "parallel") not in sys.path:
    sys.path.append(str(Path(__file__).parents[1] / "parallel"))
