"""Model FLOPs of a training step, from the model config and the real sequence lengths of a batch.

Conventions (those of Megatron-Bridge's published TFLOP/s/GPU, except where noted):

- A matmul ``[m, k] @ [k, n]`` costs ``2*m*k*n``; norms, activations, rotary and softmax are not counted.
- Training = forward + backward = 3 x forward: backward computes input and weight gradients. With frozen
  weights (LoRA) weight gradients shrink to the trainable fraction ``f``: matmuls with a weight operand cost
  ``(2 + f)`` x forward, matmuls between activations (attention scores) keep 3x.
- Attention scores count only the causal query-key pairs of each *real* sequence: packed rows are split
  where ``position_ids`` restart, a sequence of length ``L`` has ``L(L+1)/2`` pairs (Megatron: ``L^2/2``)
  and a sliding window ``w`` has ``sum_i min(i, w)``. Kernels that fill the whole ``S x S`` square of a row
  (sdpa's math path, ``torch.utils.flop_counter``'s count) do more work on the scores than is reported here.
- MoE: router + ``top_k`` routed experts + shared experts + latent projections.
- Mamba-2: projections and conv, plus the chunked SSD scan of each real sequence (``block_flops.mamba_flops``).
- Gated DeltaNet / KDA: projections and conv, plus the chunked delta rule of each real sequence (see
  ``block_flops.delta_rule_flops``).
- Output layer: ``2*hidden*vocab`` per token whose logits are computed. The fused loss computes logits only
  for tokens with a label, so an SFT batch counts its label tokens (Megatron counts every token; the two
  agree for pretraining). Each enabled MTP depth adds its projection, its blocks and one more output layer.

A block kind's forward FLOPs are the formula its record names (``models/blocks.py``, formulas in
``models/block_flops.py``); the totals are built from the records only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.block_flops import ForwardFlops, Sequences
from lightning_moe.models.blocks import pattern_kinds
from lightning_moe.models.config import ModelConfig


def pattern_flops(cfg: ModelConfig, pattern: str, seqs: Sequences, first_attention_index: int = 0) -> ForwardFlops:
    """One block per symbol, each by its record's formula, attention blocks numbered in pattern order from
    ``first_attention_index`` (as ``build_blocks`` does)."""
    total = ForwardFlops()
    for kind, attention_index in pattern_kinds(cfg, pattern, first_attention_index):
        total += kind.flops(cfg, seqs, attention_index)
    return total


def mtp_depths(cfg: ModelConfig) -> int:
    """MTP depths that run (their weights may be kept with ``enabled=False`` and skip all compute)."""
    mtp = cfg.mtp
    return mtp.num_layers if mtp is not None and mtp.enabled else 0


def mtp_projection_flops(cfg: ModelConfig, tokens: float) -> float:
    """Forward FLOPs of one MTP depth's ``eh_proj`` (embedding and hidden state, concatenated, to hidden)."""
    return 2.0 * tokens * (2 * cfg.hidden_size) * cfg.hidden_size


def output_layer_flops(cfg: ModelConfig, tokens: float) -> float:
    """Forward FLOPs of the output layer scoring ``tokens`` tokens (one head)."""
    return 2.0 * cfg.hidden_size * cfg.vocab_size * tokens


def forward_flops(cfg: ModelConfig, seqs: Sequences, output_tokens: Sequence[int] | None = None) -> ForwardFlops:
    """Forward FLOPs of the whole model over ``seqs``.

    ``output_tokens``: tokens scored by the output layer, per head (main head, then each MTP depth);
    None scores every token with every head.
    """
    depths = mtp_depths(cfg)
    if output_tokens is None:
        output_tokens = [seqs.tokens] * (1 + depths)
    if len(output_tokens) != 1 + depths:
        raise ValueError(f"output_tokens has {len(output_tokens)} entries, the model has {1 + depths} output heads")
    total = pattern_flops(cfg, cfg.pattern, seqs)
    for _ in range(depths):
        total += ForwardFlops(weights=mtp_projection_flops(cfg, seqs.tokens))
        total += pattern_flops(cfg, cfg.mtp.pattern, seqs, cfg.pattern.count("*"))
    return total + ForwardFlops(weights=output_layer_flops(cfg, sum(output_tokens)))


def output_token_counts(cfg: ModelConfig, position_ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """Tokens each output head scores: labelled tokens, and for MTP depth ``d`` those whose target ``d``
    tokens ahead is labelled and in the same packed sequence."""
    return BatchLayout(position_ids.cpu().numpy(), labels.cpu().numpy()).output_token_counts(mtp_depths(cfg))


def layout_flops(cfg: ModelConfig, layout: BatchLayout, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) of one micro-batch from its host layout (its real packed sequence
    lengths and label counts); without labels every token is scored by every output head."""
    outputs = None if layout.labels is None else layout.output_token_counts(mtp_depths(cfg))
    return forward_flops(cfg, Sequences(layout.sequence_lengths), outputs).training(trainable_fraction)


def batch_flops(
    cfg: ModelConfig,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    trainable_fraction: float = 1.0,
) -> float:
    """:func:`layout_flops` of a micro-batch given by its tensors (read back to the host)."""
    layout = BatchLayout(position_ids.cpu().numpy(), None if labels is None else labels.cpu().numpy())
    return layout_flops(cfg, layout, trainable_fraction)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token of unpacked sequences of ``seq_len`` tokens, every token labelled.

    ``seq_len=None`` gives the sequence-independent part (one-token sequences): ~6 x active parameters.
    """
    seqs = Sequences.of_length(seq_len or 1)
    return forward_flops(cfg, seqs).training(trainable_fraction) / seqs.tokens


def parameter_flops_per_token(parameters: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token of a model known only by its parameter count: forward 2N, input gradients 2N,
    weight gradients 2N x the trainable fraction (6N with every weight trained)."""
    return 2.0 * parameters * (2.0 + trainable_fraction)
