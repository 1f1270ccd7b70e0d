"""Checkpointed generator states are per rank: each rank resumes its own random stream."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from distributed_harness import run_distributed_test

from lightning_moe.modules.rng import gather_rng_states, restore_rng_states


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def _each_rank_gets_its_own_state_back() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    states = gather_rng_states()
    assert len(states) == dist.get_world_size()
    expected = _draws()
    others = [None, None]
    dist.all_gather_object(others, expected)
    assert others[0] != others[1], "the ranks must draw different numbers for the test to mean anything"
    restore_rng_states(states, rank)
    assert _draws() == expected


@pytest.mark.distributed
def test_rng_states_are_gathered_and_restored_per_rank():
    run_distributed_test(_each_rank_gets_its_own_state_back, 2)


def test_single_process_round_trip_survives_weights_only_loading(tmp_path):
    torch.manual_seed(7)
    states = gather_rng_states()
    torch.save({"rng_states": states}, tmp_path / "ckpt.pt")
    expected = _draws()
    restore_rng_states(torch.load(tmp_path / "ckpt.pt", weights_only=True)["rng_states"], rank=0)
    assert _draws() == expected
