"""``benchmarks/bench_models.py``'s GEMM reference: the captured GEMMs of a training step, their FLOPs and replay;
and the replay of the attention kernels behind its "bound".

The FLOPs of grouped GEMMs (which ``torch.utils.flop_counter`` counts as 0) must equal those of the per-expert
loop reference counted by ``FlopCounterMode``, forward and backward, else the shape rate is off by the experts'
share (the cause of a "107 % of shape GEMM rate" reading)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_moe.models.config import MoEConfig
from lightning_moe.models.layers.moe import GroupedExperts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_models  # noqa: E402


def _experts_step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor):
    def step():
        experts.zero_grad(set_to_none=True)
        experts(x, counts).square().sum().backward()
    return step


def test_grouped_gemm_flops_equal_the_per_expert_loop():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=24)
    experts = GroupedExperts(cfg, 16)
    experts.reset_parameters()
    counts = torch.tensor([5, 0, 9, 2])  # an empty expert: the offsets repeat
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)

    (calls,) = bench_models.captured_calls(_experts_step(experts, x, counts), bench_models.GEMM_OPS)
    assert {func.overloadpacket.__name__ for func, _, _ in calls} == {"_grouped_mm"}
    replay = bench_models.GemmReplay(calls)

    cfg.backend = "loop"
    with FlopCounterMode(display=False) as counter:
        _experts_step(experts, x, counts)()
    # 3 projections x (forward + input gradient + weight gradient)
    assert replay.flops == counter.get_total_flops() == 3 * 3 * 2 * 16 * 16 * 24
    assert replay.run() > 0


def test_dense_gemm_flops_equal_flop_counter():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    a = torch.randn(3, 8, 32, requires_grad=True)

    def step():
        linear.zero_grad(set_to_none=True)
        hidden = linear(a)  # addmm over the flattened rows
        (hidden @ hidden.transpose(1, 2)).sum().backward()  # bmm and its gradients

    (calls,) = bench_models.captured_calls(step, bench_models.GEMM_OPS)
    assert {"addmm", "bmm", "mm"} <= {func.overloadpacket.__name__ for func, _, _ in calls}
    with FlopCounterMode(display=False) as counter:
        step()
    assert bench_models.GemmReplay(calls).flops == counter.get_total_flops()


def test_attention_kernels_are_captured_and_replayed_apart_from_the_gemms():
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 3 * 16)
    x = torch.randn(2, 32, 16)

    def step():
        proj.zero_grad(set_to_none=True)
        q, k, v = proj(x).view(2, 32, 3, 4, 4).permute(2, 0, 3, 1, 4)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()

    gemms, attention = bench_models.captured_calls(step, bench_models.GEMM_OPS, bench_models.ATTENTION_OPS)
    assert [func.overloadpacket.__name__ for func, _, _ in attention] == list(bench_models.ATTENTION_OPS)
    assert {func.overloadpacket.__name__ for func, _, _ in gemms} == {"addmm", "mm"}  # forward, both gradients
    (forward, args, kwargs), _ = bench_models.Replay(attention).calls
    assert [tuple(a.shape) for a in args[:3]] == [(2, 4, 32, 4)] * 3 and args[4] is True  # q, k, v; is_causal
    out = forward(*args, **kwargs)[0]  # the replayed call on its own inputs is causal attention of them
    with sdpa_kernel(SDPBackend.MATH):  # an independent reference: SDPA's plain softmax(q k^T) v
        reference = torch.nn.functional.scaled_dot_product_attention(*args[:3], is_causal=True)
    torch.testing.assert_close(out, reference)
