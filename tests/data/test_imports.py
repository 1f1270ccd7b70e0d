"""``import lightning_moe.data`` stays light: heavy libraries load on first use."""

from __future__ import annotations

import subprocess
import sys


def test_import_is_lazy():
    code = ("import sys, lightning_moe.data as d; "
            "print(sorted(m for m in ('torch', 'datasets', 'transformers', 'lightning') if m in sys.modules)); "
            "d.pack_first_fit_decreasing; print('datasets' in sys.modules or 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]
