"""The bytes each collective handles in an optimizer step, counted on gloo ranks, equal the analytic count of
``lightning_moe.parallel.comm`` exactly, by kind and mesh dimension: FSDP2 all-gathers and reduce-scatters, HSDP's
all-reduces, tensor-parallel gathers, reduce-scatters and all-reduces, context-parallel key/value exchanges,
expert-parallel all-to-alls, pipeline transfers, alone and in pairs, with and without activation checkpointing, at 2 and 4 ranks (one
launch per rank count); pipeline sends and receives and the FSDP traffic of stages under the 1F1B and GPipe
schedules, with MTP's embeddings ahead, counted during ``Trainer.fit``. Layouts it does not count are refused by
name."""

from __future__ import annotations

import pytest
from comm_cases import check_counts
from distributed_harness import run_distributed_test
from parallel_cases import tiny_config

from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.comm import StepShape, model_comm_bytes

AUX = "qwen3_moe_balanced_aux"  # with a load-balancing loss, whose mean tensor parallelism all-reduces


@pytest.mark.distributed
def test_counted_bytes_equal_the_analytic_count_on_2_ranks(tmp_path):
    run_distributed_test(check_counts, 2, str(tmp_path), [
        {"dp_shard": 2}, {"dp_shard": 2, "ac": "full"}, {"dp_shard": 2, "ep": 2}, {"dp_shard": 2, "ep": 2, "ac": "full"},
        {"tp": 2}, {"tp": 2, "ac": "full"}, {"tp": 2, "ep": 2, "ac": "full"}, {"tp": 2, "case": AUX, "ac": "full"},
        {"cp": 2, "ac": "full"}, {"cp": 2, "ep": 2}, {"dp_replicate": 2},
    ], [{"pp": 2}, {"pp": 2, "schedule": "gpipe", "micro_batches": 4}, {"pp": 2, "micro_batches": 4, "ac": "full"}])


@pytest.mark.distributed
def test_counted_bytes_equal_the_analytic_count_on_4_ranks(tmp_path):
    run_distributed_test(check_counts, 4, str(tmp_path), [
        {"dp_shard": 4}, {"dp_shard": 4, "ep": 2, "ac": "full"}, {"dp_shard": 4, "ep": 4},
        {"tp": 2, "dp_shard": 2}, {"tp": 2, "dp_shard": 2, "ep": 2, "ac": "full"}, {"tp": 2, "dp_shard": 2, "ep": 4},
        {"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate": 2, "tp": 2, "case": AUX},
        {"cp": 2, "dp_shard": 2, "ac": "full"}, {"dp_replicate": 2, "cp": 2},
        {"cp": 2, "tp": 2, "case": AUX, "ac": "full"}, {"cp": 2, "tp": 2, "ep": 2},
    ], [{"pp": 2, "dp_shard": 2}, {"pp": 2, "dp_shard": 2, "schedule": "gpipe", "micro_batches": 4},
        {"pp": 2, "dp_shard": 2, "ep": 2, "ac": "full", "micro_batches": 4},
        {"pp": 2, "dp_shard": 2, "case": "deepseek_like"}, {"pp": 4, "micro_batches": 4},
        {"pp": 2, "tp": 2, "micro_batches": 4, "ac": "full"}, {"pp": 2, "cp": 2}])


@pytest.mark.parametrize(("case", "sizes", "named"), [
    ("qwen3_moe_balanced", {"pp": 2, "dp_replicate": 2}, "pp=2 with dp_replicate=2"),
    ("qwen3_moe_balanced", {"dp_replicate": 2, "ep": 2, "dp_shard": 2}, "dp_replicate=2 with ep=2"),
    ("mla_moe", {"tp": 2}, "tensor parallelism of mla blocks"),
    ("mla_moe", {"cp": 2}, "context parallelism of mla blocks"),
    ("hybrid", {"tp": 2}, "tensor parallelism of mamba blocks"),
    ("deepseek_like", {"dp_shard": 2, "cp": 2}, "MTP with tp=1, cp=2"),
])
def test_layouts_not_counted_are_refused_by_name(case, sizes, named):
    dims = ParallelDims(**sizes, world_size=4)
    with pytest.raises(NotImplementedError, match=named):
        model_comm_bytes(tiny_config(case), dims, StepShape(rows=2, seq_len=16))


def test_interleaved_pipeline_schedules_are_refused_by_name():
    shape = StepShape(rows=2, seq_len=16, micro_batches=4, pipeline_schedule="interleaved_1f1b")
    with pytest.raises(NotImplementedError, match="the interleaved_1f1b schedule"):
        model_comm_bytes(tiny_config("qwen3_moe_balanced"), ParallelDims(pp=2, world_size=2), shape)
