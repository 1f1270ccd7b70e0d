"""Layout-invariant initialization: a from-scratch model is the same on one process and on 2 ranks with FSDP2,
expert parallelism or tensor parallelism (each module draws from a generator seeded by the seed and its name)."""

from __future__ import annotations

import pytest
import seeded_init_cases
import torch
from distributed_harness import run_distributed_test
from parallel_cases import tiny_config

from lightning_moe.models.seeded_init import module_seed
from lightning_moe.modules.causal_lm import build_decoder

pytestmark = pytest.mark.distributed


def test_same_weights_on_every_layout():
    cases = [("deepseek_like", {"dp_shard": 2}), ("qwen3_moe", {"ep": 2}), ("llama", {"tp": 2}),
             ("hybrid", {"dp_shard": 2})]
    run_distributed_test(seeded_init_cases.check_layouts, 2, cases)


def test_seed_per_module_name():
    assert module_seed(0, "layers.0") == module_seed(0, "layers.0")
    assert len({module_seed(0, "layers.0"), module_seed(0, "layers.1"), module_seed(1, "layers.0")}) == 3
    # a model's blocks do not depend on which other blocks exist (what a pipeline stage holds)
    whole = build_decoder(tiny_config("llama"), seed=3)
    torch.manual_seed(0)  # the caller's generator state plays no part
    again = build_decoder(tiny_config("llama"), seed=3)
    for name, param in whole.named_parameters():
        assert torch.equal(param, again.get_parameter(name)), name
    assert not torch.equal(whole.layers["0"].attn.q_proj.weight, whole.layers["2"].attn.q_proj.weight)
