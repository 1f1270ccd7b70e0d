"""Expert parallelism on the generic path over the transformers MoE architectures of the published rows: tiny
random Qwen3-MoE (forced through transformers), MiMo-V2-Flash, Laguna, GLM-MoE-DSA (GLM-5), Kimi-Linear,
Qwen3-Next and DeepSeek-V4 models built from their config classes, their standardized experts split over ep=2
(2 gloo ranks) and ep=4 (4 ranks, one expert each), against one process: the first backward's loss and every
gradient, five Trainer steps' losses, and, for routers with a correction bias, the aux-loss-free bias after five
updates (the same on every rank). One launch per rank count runs every architecture. Also: balanced routing
(``force_balanced``) and the bias update on one process for each architecture, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_harness import run_distributed_test
from ep_architecture_cases import (
    correction_biases,
    every_architecture,
    fit_with_bias_updates,
    pipelines_match,
)
from expert_parallel_cases import assert_same_gradients
from tiny_hf_models import batch
from tiny_hf_moes import ARCHITECTURES, save_tiny_moe

from lightning_moe.models.hf import HFModelConfig, build_hf_model
from lightning_moe.models.hf_experts import (
    correction_bias_routers,
    standardized_experts,
    update_correction_biases,
)

# architectures whose routers add an e_score_correction_bias to the scores they choose by
WITH_BIAS = {"mimo_v2_flash", "laguna", "glm_moe_dsa", "kimi_linear", "deepseek_v4"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every architecture's checkpoint and its one-process five-step run (losses, final biases)."""
    root = tmp_path_factory.mktemp("ep_architectures")
    single = {}
    for name in ARCHITECTURES:
        save_tiny_moe(name, root / name)
        single[name] = fit_with_bias_updates(str(root / name), str(root / f"{name}_single"), None, name in WITH_BIAS)
    return root, single


def assert_matches_one_process(root, single: dict, name: str) -> None:
    assert_same_gradients(root / f"{name}_grads.pt", str(root / name), skewed=False)
    split = json.loads((root / f"{name}_fit.json").read_text())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in split["split"]), (name, split["split"])
    assert len(split["losses"]) == 5
    assert split["losses"] == pytest.approx(single[name]["losses"], abs=1e-5), name
    assert split["biases"].keys() == single[name]["biases"].keys()
    assert bool(split["biases"]) == (name in WITH_BIAS), name
    for router, bias in single[name]["biases"].items():
        assert split["biases"][router] == pytest.approx(bias, abs=1e-6), (name, router)
        assert any(b != 0 for b in bias), f"{name}: {router}'s bias never moved"
    assert split["same_on_every_rank"], name
    if name in WITH_BIAS:  # each rank's own load was lopsided, the global one even: no bias moved
        initial = correction_biases(build_hf_model(HFModelConfig(hf=str(root / name), native="never")).hf)
        assert split["skewed_update"].keys() == initial.keys()
        for router, bias in initial.items():
            assert split["skewed_update"][router] == pytest.approx(bias.tolist(), abs=1e-7), (name, router)


def run_layout(checkpoints, ranks: int) -> None:
    root, single = checkpoints
    architectures = {name: name in WITH_BIAS for name in ARCHITECTURES}
    run_distributed_test(every_architecture, ranks, str(root), architectures, {"dp_shard": ranks, "ep": ranks})
    for name in ARCHITECTURES:
        assert_matches_one_process(root, single, name)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_on_every_architecture_matches_one_process(checkpoints):
    run_layout(checkpoints, 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep4_on_every_architecture_matches_one_process(checkpoints):
    run_layout(checkpoints, 4)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_force_balanced_routes_round_robin_on_every_architecture(checkpoints, name):
    """Benchmarks' balanced routing: every experts module of the architecture receives slot i -> expert i % E,
    and the router still gets a gradient."""
    root, _ = checkpoints
    model = build_hf_model(HFModelConfig(hf=str(root / name), native="never", force_balanced=True))
    seen = []
    for _, experts in standardized_experts(model.hf):
        experts.register_forward_pre_hook(lambda module, args: seen.append((module.num_experts, args[1].clone())))
    data = batch(rows=2)
    model(data["input_ids"], labels=data["labels"]).loss_sum.backward()
    assert len(seen) == len(standardized_experts(model.hf)) > 0
    for experts, index in seen:
        assert torch.equal(index.flatten(), torch.arange(index.numel()) % experts)
    routers = [n for n, p in model.hf.named_parameters() if n.endswith("gate.weight") and "mlp" in n]
    assert routers and all(model.hf.get_parameter(n).grad.abs().sum() > 0 for n in routers)


def test_bias_update_follows_the_load_and_is_refused_without_a_bias(checkpoints):
    """One process: each correction bias moves by rate * sign(mean load - load) of the copies counted in
    training forwards (not in eval ones); a model whose routers have no correction bias is refused."""
    root, _ = checkpoints
    for name in sorted(WITH_BIAS):
        model = build_hf_model(HFModelConfig(hf=str(root / name), native="never", bias_update_rate=0.5))
        counted = {}
        for block, _, experts in correction_bias_routers(model.hf):
            experts.register_forward_pre_hook(
                lambda module, args, block=block, seen=counted: seen.setdefault(block, []).append(args[1].flatten().clone()))
        before = correction_biases(model.hf)
        data = batch(rows=2)
        model.eval()
        with torch.no_grad():
            model(data["input_ids"])
        counted.clear()
        model.train()
        model(data["input_ids"], labels=data["labels"])
        update_correction_biases(model)
        after = correction_biases(model.hf)
        assert after.keys() == before.keys() == counted.keys() and after, name
        for block, index in counted.items():
            load = torch.bincount(torch.cat(index), minlength=before[block].numel()).float()
            expected = before[block] + 0.5 * torch.sign(load.mean() - load)
            torch.testing.assert_close(after[block], expected, msg=f"{name} {block}")
    for name in ("qwen3_moe", "qwen3_next"):
        with pytest.raises(ValueError, match=r"model.bias_update_rate=0.5: \w+ForCausalLM has no router with an "
                                             r"e_score_correction_bias"):
            build_hf_model(HFModelConfig(hf=str(root / name), native="never", bias_update_rate=0.5))


@pytest.mark.distributed
def test_pp2_stages_of_glm_moe_dsa_and_laguna_match_one_process(checkpoints):
    """The GLM-5.3 recipe's pipeline stages on the generic path: tiny GLM-MoE-DSA (sparse-attention indexer, dense
    then MoE layers) and Laguna split into two stages train like one process (6 steps' losses and gradient norms,
    validation, first-step gradients; ``parallel/pipeline_cases.py``)."""
    import pipeline_cases

    root, _ = checkpoints
    references = {f"hf:{root / name}": pipeline_cases.fit(f"hf:{root / name}", None, root / f"pp1_{name}")
                  for name in ("glm_moe_dsa", "laguna")}
    run_distributed_test(pipelines_match, 2, str(root), references, init_process_group=False)
