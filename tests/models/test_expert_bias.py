"""Aux-loss-free balancing (DeepSeek-V3): the expert bias steers selection toward balance, never the gate weights,
and every data-parallel rank applies the same update from the all-reduced token counts."""

from __future__ import annotations

import torch
from distributed_harness import run_distributed_test

from lightning_moe.models.config import MoEConfig
from lightning_moe.models.layers.moe import MoE, update_expert_bias

HIDDEN, EXPERTS, TOKENS = 16, 8, 256
RATE = 0.02


def _skewed_moe(n_group: int = 1, topk_group: int = 1) -> MoE:
    """A sigmoid router whose weights favour experts 0 and 1 for the inputs of :func:`_skewed_batch`."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=8, score_func="sigmoid",
                        score_correction_bias=True, bias_update_rate=RATE, n_group=n_group, topk_group=topk_group,
                        norm_topk_prob=True, routed_scaling_factor=2.5, num_shared_experts=1), HIDDEN)
    moe.reset_parameters(0.1)
    with torch.no_grad():
        moe.router.weight[:2] += 0.5 * _direction()
    return moe.train()


def _direction() -> torch.Tensor:
    return torch.ones(HIDDEN) / HIDDEN**0.5


def _skewed_batch(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=gen) * 0.5 + 2.0 * _direction()


def _imbalance(moe: MoE, x: torch.Tensor) -> float:
    """max / mean tokens per expert of one forward over ``x`` (1 = perfectly balanced)."""
    with torch.no_grad():
        load = torch.bincount(moe.router(x).experts.flatten(), minlength=EXPERTS).float()
    return (load.max() / load.mean()).item()


def test_bias_update_moves_load_toward_balance():
    moe, x = _skewed_moe(), _skewed_batch(0)
    history = [_imbalance(moe, x)]
    assert history[0] > 3.0  # nearly every token picks experts 0 and 1
    for _ in range(60):
        moe(x)  # training mode: counts the tokens per expert
        update_expert_bias(moe)
        history.append(_imbalance(moe, x))
    assert history[-1] < 1.5, history
    assert max(history[-10:]) < history[0] / 2
    bias = moe.router.score_correction_bias
    assert bias[:2].max() < 0 < bias[2:].max()  # overloaded experts pushed down, idle ones up
    assert not moe.tokens_per_expert.any()  # counts restart after each update


def test_bias_picks_experts_but_gate_weights_come_from_unbiased_scores():
    """Against transformers' DeepSeek-V3 router (group-limited top-k) with the same weights and bias."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe, x = _skewed_moe(n_group=4, topk_group=2), _skewed_batch(1)
    for _ in range(10):
        moe(x)
        update_expert_bias(moe)
    router = moe.router
    routing = router(x)

    scores = torch.sigmoid(x @ router.weight.T)
    gathered = scores.gather(1, routing.experts)
    assert torch.allclose(routing.weights, 2.5 * gathered / gathered.sum(-1, keepdim=True), atol=1e-6)
    unbiased_choice = scores.topk(2, dim=-1).indices
    assert (routing.experts.sort(-1).values != unbiased_choice.sort(-1).values).any()  # the bias changed picks

    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=2,
                                           n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    theirs = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(router.weight)
        theirs.e_score_correction_bias.copy_(router.score_correction_bias)
    _, their_weights, their_experts = theirs(x)
    order, their_order = routing.experts.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(routing.experts.gather(1, order), their_experts.gather(1, their_order))
    assert torch.allclose(routing.weights.gather(1, order), their_weights.gather(1, their_order), atol=1e-6)


def _ranks_apply_the_all_reduced_update() -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    moe = _skewed_moe()
    batches = [_skewed_batch(10 + r) for r in range(world)]
    expected = torch.zeros(EXPERTS)
    for _ in range(3):
        # the rule on the tokens of every rank: bias += rate * sign(mean load - load)
        with torch.no_grad():
            load = sum(torch.bincount(moe.router(b).experts.flatten(), minlength=EXPERTS) for b in batches).float()
        expected += RATE * torch.sign(load.mean() - load)
        moe(batches[rank])  # each rank counts its own tokens only
        update_expert_bias(moe)
    bias = moe.router.score_correction_bias
    gathered = [torch.empty(EXPERTS) for _ in range(world)]
    dist.all_gather(gathered, bias)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert torch.allclose(bias, expected, rtol=0, atol=1e-7), (bias, expected)
    assert expected.abs().sum() > 0


def test_bias_update_is_all_reduced_across_ranks():
    run_distributed_test(_ranks_apply_the_all_reduced_update, 2)
