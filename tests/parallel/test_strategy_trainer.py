"""``ParallelStrategy`` under a real ``Trainer`` with ``CausalLM``: a distributed checkpoint written with 2-way
FSDP resumes with 2-way tensor parallelism and continues with the same losses and gradient norms; HSDP with
gradient accumulation all-reduces across replicas once per step and trains like one process."""

from __future__ import annotations

import pytest
import strategy_trainer_cases
from distributed_harness import run_distributed_test

pytestmark = pytest.mark.distributed


def test_fsdp_checkpoint_resumes_with_tensor_parallelism(tmp_path):
    run_distributed_test(strategy_trainer_cases.resume_on_another_mesh, 2, str(tmp_path), init_process_group=False)


def test_gradient_accumulation_matches_one_process(tmp_path):
    run_distributed_test(strategy_trainer_cases.accumulation_matches_one_process, 2, str(tmp_path),
                         init_process_group=False)
