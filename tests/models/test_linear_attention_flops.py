"""Training FLOPs of Gated DeltaNet and KDA models from the config against FlopCounterMode on a real step.

FlopCounterMode counts matmuls only, so two terms are swapped for what it sees: causal attention scores for
sdpa's math path full square (torch's own formula), and the conv's multiply-adds (elementwise taps) left out;
and the delta rule's backward as it runs: KDA's recomputes the forward under autograd (twice the forward's
products, plus the forward once more), Gated DeltaNet's hand-written one is counted product by product
(:func:`head_decay_executed_flops`). Rows are whole chunks, so every chunk is a full square; chunks of 32 solve
in two 16-row blocks."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.config import (
    AttentionConfig,
    LinearAttentionConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
)


def tiny_config(symbol: str) -> ModelConfig:
    kda = symbol == "K"
    return ModelConfig(
        vocab_size=96, hidden_size=48, pattern=f"{symbol}-*E{symbol}E",
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=12, qk_norm=True, output_gate=not kda),
        mlp=MLPConfig(intermediate_size=64),
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=24, num_shared_experts=1,
                      shared_intermediate_size=32, shared_expert_gate=not kda, backend="loop"),
        linear_attention=LinearAttentionConfig(num_k_heads=4 if kda else 2, num_v_heads=4, head_k_dim=8,
                                               head_v_dim=8 if kda else 10, chunk_size=32),
        norm_offset=not kda,
    )


def head_decay_executed_flops(C: int, dk: int, dv: int) -> int:
    """Matmul FLOPs per value head and chunk of the one-decay-per-head delta rule's forward + backward
    (``layers/delta_rule.py``), which reads the state in every chunk (a zero one in the first). Chunk-parallel
    part: ``k k^T``, ``q k^T``, the inverse, ``T [v | k]``, run again in backward but for the inverse, which
    forward keeps. Forward scan:
    ``W S``, ``k_end^T v_new``, ``q_start S``, ``qk v_new``. Backward: ``W S``, ``qk^T dO``, ``q_start^T dO``,
    two products per chunk for the state's gradient, ``dO v_new^T``, ``dO S^T``, ``v_new dS^T``, ``dv_new S^T``,
    ``T^T dX``, ``dR X^T`` and the four products back to ``q`` and ``k``."""
    from lightning_moe.models.layers.delta_rule import inverse_flops

    parallel = 2 * 2 * C * C * dk + inverse_flops(C) + 2 * C * C * (dk + dv)
    forward = parallel + 3 * 2 * C * dk * dv + 2 * C * C * dv
    backward = (parallel - inverse_flops(C) + 7 * 2 * C * dk * dv + 2 * 2 * C * C * dv + 2 * 2 * C * C * (dk + dv)
                + 4 * 2 * C * C * dk)
    return forward + backward


@pytest.mark.parametrize("symbol", ["G", "K"], ids=["gated_deltanet", "kda"])
def test_flops_match_flop_counter(symbol):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    from lightning_moe.models.block_flops import Sequences, delta_rule_flops
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.models.flops import batch_flops

    cfg = tiny_config(symbol)
    la, att = cfg.linear_attention, cfg.attention
    batch, seq = 2, 3 * la.chunk_size
    torch.manual_seed(0)
    model = Decoder(cfg).train()
    model.init_weights()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = ids.roll(-1, dims=1).masked_fill(torch.rand(batch, seq, generator=gen) < 0.3, -100)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels).loss_sum.backward()

    expected = batch_flops(cfg, torch.arange(seq).expand(batch, -1), labels)
    causal_scores = 2 * 2 * att.num_heads * att.head_dim * batch * seq * (seq + 1) // 2
    q, kv = (batch, att.num_heads, seq, att.head_dim), (batch, att.num_kv_heads, seq, att.head_dim)
    expected += 3 * cfg.pattern.count("*") * (sdpa_flop_count(q, kv, kv) - causal_scores)
    mixers = cfg.pattern.count(symbol)
    key = la.num_k_heads * la.head_k_dim
    conv_dim = 3 * key if symbol == "K" else 2 * key + la.num_v_heads * la.head_v_dim
    expected -= 3 * mixers * 2 * batch * seq * la.conv_kernel * conv_dim
    # model FLOPs count the delta rule as three forwards and leave recomputation out (as activation checkpointing)
    rule = delta_rule_flops(cfg, Sequences.of_length(seq, batch))
    if symbol == "K":  # autograd through the recomputed forward
        expected += mixers * rule
    else:
        chunks = batch * seq // la.chunk_size
        executed = la.num_v_heads * chunks * head_decay_executed_flops(la.chunk_size, la.head_k_dim, la.head_v_dim)
        expected += mixers * (executed - 3 * rule)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-6)
