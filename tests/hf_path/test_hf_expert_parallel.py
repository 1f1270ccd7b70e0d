"""Expert parallelism on the generic path: Qwen3-MoE forced through transformers (``native: never``), its
standardized experts split over ep, against one process: five Trainer steps' losses, the first backward's
gradients element by element, and a step whose routing leaves one ep rank without a token; and benchmarks'
balanced routing (``force_balanced``) there."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_harness import run_distributed_test
from expert_parallel_cases import (
    assert_same_gradients,
    expert_parallel_gradients,
    fit_expert_parallel,
    gradients_at_layouts,
)
from tiny_hf_models import batch, qwen3_moe_config, save_tiny
from torch import nn
from trainer_cases import fit

from lightning_moe.models.hf import HFModelConfig, build_hf_model, native_checkpoint_dir
from lightning_moe.models.hf_experts import standardized_experts
from lightning_moe.parallel.hf_expert import check_hf_expert_parallel


@pytest.mark.distributed
def test_ep2_matches_one_process_in_losses_gradients_and_skewed_routing(tmp_path):
    model_dir = str(save_tiny(qwen3_moe_config(), tmp_path / "qwen3_moe"))
    single, _ = fit(model_dir, str(tmp_path / "single"), steps=5, native="never")
    sizes = {"dp_shard": 2, "ep": 2}

    root = tmp_path / "ep"
    root.mkdir()
    run_distributed_test(fit_expert_parallel, 2, model_dir, str(root), sizes, init_process_group=False)
    record = json.loads((root / "losses.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in record["split"], record["split"]
    assert len(record["losses"]) == 5 and record["losses"] == pytest.approx(single, abs=1e-5)

    for skewed in (False, True):
        out = tmp_path / f"grads_{skewed}.pt"
        run_distributed_test(expert_parallel_gradients, 2, model_dir, str(out), sizes, skewed)
        split = assert_same_gradients(out, model_dir, skewed)
        if skewed:  # ep rank 1 (experts 2, 3) received no token and still finished the step
            rank0, rank1 = split["local_expert_grad_norms"]
            name = "model.layers.0.mlp.experts.gate_up_proj"
            assert rank0[name] > 0 and rank1[name] == 0


@pytest.mark.distributed
def test_ep4_and_ep2_with_sharded_experts_match_one_process_gradients(tmp_path):
    """Four ranks: one expert per rank (ep=4), and ep=2 with each expert FSDP-sharded over the other pair
    (expert_fsdp of 2)."""
    model_dir = str(save_tiny(qwen3_moe_config(), tmp_path / "qwen3_moe"))
    layouts = [{"dp_shard": 4, "ep": 4}, {"dp_shard": 4, "ep": 2}]
    run_distributed_test(gradients_at_layouts, 4, model_dir, str(tmp_path), layouts)
    for i in range(len(layouts)):
        assert_same_gradients(tmp_path / f"grads_{i}.pt", model_dir, skewed=False)


def test_experts_that_are_not_the_standardized_module_are_refused_by_name(tmp_path):
    class PerExpertMLPs(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    with pytest.raises(ValueError, match=r"ep=2: PerExpertMLPs's experts \(ModuleList\) are not transformers' "
                                         r"standardized experts module"):
        check_hf_expert_parallel(PerExpertMLPs(), 2)
    model = build_hf_model(HFModelConfig(hf=str(save_tiny(qwen3_moe_config(num_experts=6), tmp_path / "six")), native="never"))
    with pytest.raises(ValueError, match=r"ep=4 does not divide num_experts=6 of model.layers.0.mlp.experts"):
        check_hf_expert_parallel(model.hf, 4)


def test_force_balanced_routes_round_robin_and_trains(tmp_path):
    """Benchmarks on the generic path: every experts module receives each expert's equal share of the token
    copies (slot i -> expert i % E); the loss still backpropagates into the router."""
    model_dir = str(save_tiny(qwen3_moe_config(), tmp_path / "qwen3_moe"))
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never", force_balanced=True))
    seen = []
    for _, experts in standardized_experts(model.hf):
        experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    data = batch(rows=4)
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    tokens = data["input_ids"].numel()
    assert len(seen) == 2
    for index in seen:
        assert torch.equal(index.flatten(), torch.arange(tokens * 2) % 4)
    assert model.hf.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    routed = build_hf_model(HFModelConfig(hf=model_dir, native="never"))
    assert not torch.allclose(routed(data["input_ids"], labels=data["labels"]).loss_sum, loss.detach())
    with pytest.raises(ValueError, match=r"model.force_balanced=true on Qwen3MoeForCausalLM, which trains through "
                                         r"its native family"):
        native_checkpoint_dir(HFModelConfig(hf=model_dir, force_balanced=True))
