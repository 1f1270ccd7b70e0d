"""TokenDispatcher's dispatch and combine against a direct per-slot formula: rows sorted by expert (stable), and
token t's output ``sum_j w[t, j] * f_{e[t, j]}(x[t])``; outputs and gradients of x and of the weights."""

from __future__ import annotations

import torch

from lightning_moe.models.layers.moe import Routing, TokenDispatcher


def test_dispatch_combine_equal_the_per_slot_sum():
    torch.manual_seed(0)
    tokens, dim, num_experts, top_k = 37, 8, 6, 3
    # experts 4 and 5 never chosen: empty groups
    experts = torch.stack([torch.randperm(4)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, requires_grad=True)
    scale = torch.arange(1.0, num_experts + 1)  # "expert e" multiplies its rows by e + 1
    x = torch.randn(tokens, dim, requires_grad=True)
    routing = Routing(experts=experts, weights=weights, scores=torch.rand(tokens, num_experts))
    grad_out = torch.randn(tokens, dim)

    dispatcher = TokenDispatcher()
    rows, counts, state = dispatcher.dispatch(x, routing, num_experts)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=num_experts).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), counts)
    # rows sorted by expert, slots of one expert in token order
    slots = sorted(range(tokens * top_k), key=lambda slot: (int(experts.flatten()[slot]), slot))
    assert torch.equal(rows, x[[slot // top_k for slot in slots]])
    out = dispatcher.combine(rows * scale[expert_of_row, None], routing, state)
    got = torch.autograd.grad(out, (x, weights), grad_out)

    expected = (weights[..., None] * x[:, None, :] * scale[experts][..., None]).sum(dim=1)
    want = torch.autograd.grad(expected, (x, weights), grad_out)
    torch.testing.assert_close(out, expected)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
