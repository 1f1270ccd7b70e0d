"""LoRA and MXFP8 / FP8 under ParallelStrategy on two gloo ranks: FSDP2 and expert parallelism train, save
distributed checkpoints (adapter-only for LoRA) and resume to the same losses; FP8 all-gather equals the
bf16 all-gather."""

from __future__ import annotations

import parallel_converter_cases
import pytest
from distributed_harness import run_distributed_test
from tiny_hf import save_tiny

pytestmark = pytest.mark.distributed


def test_converters_under_fsdp_and_expert_parallelism(tmp_path):
    base = save_tiny("qwen3_moe", tmp_path / "base")
    run_distributed_test(parallel_converter_cases.check_converters, 2, str(base), str(tmp_path),
                         init_process_group=False, timeout=900)
