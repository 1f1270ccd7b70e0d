"""MiMo-V2's blocks (tests/parallel/parallel_cases.py ``mimo_like``: full then sliding-window attention with their own
kv heads, sinks and rope theta, narrow value heads, scaled values, a sigmoid router with selection bias, a sliding
MTP depth) under the layout kinds of the MiMo recipes (configs/mimo_v2/): EP with FSDP2 (V2.6-Flash-RL, EP 64 on 64),
CP with EP (V2.6-Pro-RL's CP 8 x EP 64), and a pipeline with CP x EP (V2.6-Pro-RL's PP 2 x CP 8 x EP 64; its
stages' EP also V2.5-Pro's PP 18 x EP 8), each on 4 gloo ranks against one process: five steps' losses and gradient norms,
first-step gradients, the logits of packed rows (run_layout), validation losses (pipelines in a Trainer)."""

from __future__ import annotations

import parallel_cases
import pipeline_cases
import pytest
from distributed_harness import run_distributed_test
from test_pipeline import references

pytestmark = pytest.mark.distributed


def test_mimo_layouts_match_single_process():
    cases = [
        ("run_layout", ("fsdp x ep=4, sliding settings, sinks, MTP", "mimo_like", {"dp_shard": 4, "ep": 4}), {}),
        ("run_layout", ("cp=2 x fsdp x ep=4, windows across rank boundaries, MTP targets", "mimo_like",
                        {"dp_shard": 2, "cp": 2, "ep": 4}), {}),
    ]
    run_distributed_test(parallel_cases.check_cases, 4, cases)


def test_mimo_pipelines_match_single_process(tmp_path):
    cases = [("mimo_pp2_cp2_ep2", "mimo_like", {"pp": 2, "cp": 2, "ep": 2})]
    run_distributed_test(pipeline_cases.check_pipelines, 4, str(tmp_path), references(tmp_path, "mimo_like"), cases,
                         init_process_group=False)
