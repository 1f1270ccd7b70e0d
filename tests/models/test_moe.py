"""Grouped-GEMM experts equal the per-expert loop, forward and backward; routing matches its definition."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.config import MoEConfig
from lightning_moe.models.layers.moe import MoE, Router


def _moe(activation: str, expert_bias: bool, **kwargs) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=24, activation=activation, expert_bias=expert_bias,
                    num_shared_experts=1, **kwargs)
    moe = MoE(cfg, hidden_size=16)
    moe.reset_parameters(0.2)
    if expert_bias:
        for bias in (moe.experts.gate_bias, moe.experts.up_bias, moe.experts.down_bias):
            if bias is not None:
                torch.nn.init.normal_(bias, std=0.1)
    return moe


@pytest.mark.parametrize(
    "activation,expert_bias", [("swiglu", False), ("relu2", False), ("swiglu_clamped", True)]
)
def test_grouped_mm_equals_loop_forward_and_backward(activation, expert_bias):
    grouped = _moe(activation, expert_bias)
    loop = _moe(activation, expert_bias, backend="loop")
    loop.load_state_dict(grouped.state_dict())
    # route nothing to expert 5 so the zero-token path is exercised
    with torch.no_grad():
        grouped.router.weight[5] = -10.0
        loop.router.weight[5] = -10.0
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_grouped, out_loop = grouped(x1), loop(x2)
    assert torch.allclose(out_grouped, out_loop, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out_grouped)
    out_grouped.backward(grad)
    out_loop.backward(grad)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for (name, a), (_, b) in zip(grouped.named_parameters(), loop.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5), name


def test_loop_reference_matches_dense_per_token_computation():
    """Independent check of the reference itself: every token through its experts one by one."""
    moe = _moe("swiglu", False, backend="loop")
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
    routing = moe.router(x)
    expected = torch.zeros_like(x)
    e = moe.experts
    for t in range(x.shape[0]):
        for k in range(2):
            i = routing.experts[t, k]
            h = torch.nn.functional.silu(x[t] @ e.gate_proj[i].T) * (x[t] @ e.up_proj[i].T)
            expected[t] += routing.weights[t, k] * (h @ e.down_proj[i].T)
    expected += moe.shared_experts(x)
    assert torch.allclose(moe(x), expected, atol=1e-5)


def test_sigmoid_group_limited_router_with_bias_matches_definition():
    cfg = MoEConfig(num_experts=8, top_k=2, score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                    routed_scaling_factor=2.5, score_correction_bias=True)
    router = Router(cfg, hidden_size=16)
    router.reset_parameters(0.5)
    router.score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(4))
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    biased = scores + router.score_correction_bias
    for t in range(20):
        groups = biased[t].view(4, 2).sum(-1)  # top-2 of a 2-expert group is the whole group
        allowed = set(torch.topk(groups, 2).indices.tolist())
        candidates = [i for i in range(8) if i // 2 in allowed]
        best = sorted(candidates, key=lambda i: -biased[t, i].item())[:2]
        assert set(routing.experts[t].tolist()) == set(best)
        w = scores[t, best]
        expected = 2.5 * w / w.sum()
        got = {e: routing.weights[t, k].item() for k, e in enumerate(routing.experts[t].tolist())}
        for e, value in zip(best, expected.tolist()):
            assert abs(got[e] - value) < 1e-6



@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_scores_stay_fp32_under_autocast(score_func):
    """Routing decisions come from fp32 logits, also under bf16-mixed autocast."""
    router = Router(MoEConfig(num_experts=8, top_k=2, score_func=score_func, router_bias=True), hidden_size=32)
    router.reset_parameters(0.5)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(6))
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(got.scores, want.scores) and torch.equal(got.experts, want.experts)

def test_force_balanced_routing_spreads_tokens_evenly():
    cfg = MoEConfig(num_experts=4, top_k=2, force_balanced=True)
    router = Router(cfg, 8)
    router.reset_parameters()
    routing = router(torch.randn(10, 8))
    counts = torch.bincount(routing.experts.flatten(), minlength=4)
    assert counts.max() - counts.min() <= 1


def test_balancing_state_survives_a_bf16_cast():
    """precision=bf16-true casts every floating tensor of the module: counts and the selection bias must not
    lose the small steps aux-free balancing relies on."""
    from lightning_moe.models.layers.moe import update_expert_bias

    moe = MoE(MoEConfig(num_experts=4, top_k=1, score_func="sigmoid", score_correction_bias=True,
                        bias_update_rate=1e-3), hidden_size=8)
    moe.reset_parameters()
    moe.router.score_correction_bias.fill_(0.5)
    moe.to(torch.bfloat16).train()
    assert moe.router.score_correction_bias.dtype == torch.float32
    assert moe.tokens_per_expert.dtype == torch.long
    moe(torch.randn(300, 8, dtype=torch.bfloat16))
    assert int(moe.tokens_per_expert.sum()) == 300
    update_expert_bias(moe)
    moved = moe.router.score_correction_bias - 0.5
    assert moved.abs().max().item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_equals_megatrons(score_func):
    """Megatron-core's switch load-balancing loss: fractions from the plain top-k of the (normalized) scores,
    not from the expert bias and group limits that pick the experts tokens are sent to."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, score_func=score_func, aux_loss_coeff=1e-2,
                    score_correction_bias=score_func == "sigmoid", n_group=4, topk_group=2)
    moe = MoE(cfg, hidden_size=16).train()
    moe.reset_parameters(0.5)
    if cfg.score_correction_bias:
        moe.router.score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(7))
    moe(x)
    logits = x @ moe.router.weight.T
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, 2, score_func)
    expected = switch_load_balancing_loss_func(scores, routing_map.sum(0), 40, 2, 8, 1e-2)
    assert moe.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("output_router_logits", [True, False])
def test_aux_loss_from_a_hub_config_matches_transformers(tmp_path, output_router_logits):
    """transformers adds router_aux_loss_coef * its load-balancing loss only with output_router_logits; with one
    MoE layer the translated coefficient gives exactly that loss."""
    import transformers

    from lightning_moe.checkpoint.load import load_pretrained

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, output_router_logits=output_router_logits,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).train()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    native = load_pretrained(tmp_path).train()
    ids = torch.randint(0, 64, (2, 10))
    out = native(ids, labels=ids)
    if not output_router_logits:
        assert native.config.moe.aux_loss_coeff == 0.0 and out.aux_loss is None
        return
    expected = 0.02 * hf(ids, output_router_logits=True).aux_loss
    assert out.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_experts_keep_neither_the_token_copies_nor_the_activation():
    """Backward copies the tokens into expert order again and recomputes the activation: of the [tokens * top_k,
    ...] rows, a MoE forward keeps the gate and up projections, the activation's output (the down projection's
    input) and the down projection's output (the routing weights' gradient) only."""
    moe = _moe("swiglu", False)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe(x)
    rows = 3 * 10 * moe.cfg.top_k
    kept = sorted(tuple(t.shape) for t in saved if t.is_floating_point() and t.dim() == 2 and t.shape[0] == rows
                  and t.shape[1] > 1)  # not the routing weights [rows, 1]
    assert kept == [(rows, 16), (rows, 24), (rows, 24), (rows, 24)]
