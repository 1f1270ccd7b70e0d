"""``benchmarks/gpu_check.py --dry-run``: every section of the prepared GPU check runs on CPU at toy sizes (the
command a GPU session will run, minus the GPU), so the script cannot rot before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from distributed_harness import HANG_GUARD_S

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["environment", "twins", "compile", "flex", "fp8", "transformer_engine", "timings"]
    assert result["dry_run"] and sections["environment"]["torch"]
    assert all(s["status"] in ("ok", "skipped") for s in sections.values()), sections
    assert set(sections["twins"]["twins"]) == {"dense", "qwen3_moe", "deepseek_mla_moe", "nemotron_h", "gpt_oss"}
    assert all(len(t["device_losses"]) == 5 for t in sections["twins"]["twins"].values())
    assert sections["compile"]["match"] and sections["flex"]["max_abs_error"]["out"] < 1e-4
    assert set(sections["fp8"]["recipes"]) == {"tensorwise", "rowwise", "mxfp8"}
    if sections["transformer_engine"]["status"] == "skipped":
        assert "pip install '.[te]'" in sections["transformer_engine"]["error_without_te"]
        assert "te_modules: true" in sections["transformer_engine"]["te_modules_error_without_te"]
    rows = sections["timings"]["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 4 and all(r["tflops_per_gpu"] > 0 for r in rows)
    assert [r["published_tflops_per_gpu"] for r in rows] == [402, 423, 277, 328]
    assert "| Llama3 8B LoRA |" in done.stdout
