"""The bytes each collective handles in an optimizer step, counted on gloo ranks, equal the analytic count of
``lightning_moe.parallel.comm`` exactly: FSDP2 all-gathers and reduce-scatters, expert-parallel all-to-alls, with
and without activation checkpointing, at 2 and 4 ranks (one launch per rank count)."""

from __future__ import annotations

import pytest
from comm_cases import check_layouts
from distributed_harness import run_distributed_test


@pytest.mark.distributed
def test_counted_bytes_equal_the_analytic_count_on_2_ranks():
    run_distributed_test(check_layouts, 2, [{"dp_shard": 2}, {"dp_shard": 2, "ac": "full"},
                                            {"dp_shard": 2, "ep": 2}, {"dp_shard": 2, "ep": 2, "ac": "full"}])


@pytest.mark.distributed
def test_counted_bytes_equal_the_analytic_count_on_4_ranks():
    run_distributed_test(check_layouts, 4, [{"dp_shard": 4}, {"dp_shard": 4, "ep": 2, "ac": "full"},
                                            {"dp_shard": 4, "ep": 4}])
