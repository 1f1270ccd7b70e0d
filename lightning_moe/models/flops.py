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
- Mamba-2: projections and conv, plus the chunked SSD scan of each real sequence (see :func:`mamba_flops`).
- Gated DeltaNet / KDA: projections and conv, plus the chunked delta rule of each real sequence (see
  :func:`delta_rule_flops`).
- Output layer: ``2*hidden*vocab`` per token whose logits are computed. The fused loss computes logits only
  for tokens with a label, so an SFT batch counts its label tokens (Megatron counts every token; the two
  agree for pretraining). Each enabled MTP depth adds its projection, its blocks and one more output layer.

A block type's forward FLOPs are one function in :data:`BLOCK_FLOPS` (by pattern symbol) or
:data:`ATTENTION_FLOPS` (by ``attention.type``); the totals are built from those tables only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.config import BLOCK_SYMBOLS, AttentionConfig, ModelConfig
from lightning_moe.models.layers.delta_rule import solve_flops


@dataclass(frozen=True)
class Sequences:
    """The sequences one forward pass runs over: their lengths (1-d int64, a host array)."""

    lengths: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", np.asarray(self.lengths, dtype=np.int64))

    @classmethod
    def of_length(cls, seq_len: int, count: int = 1) -> Sequences:
        return cls(np.full((count,), seq_len, dtype=np.int64))

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | np.ndarray) -> Sequences:
        """Every packed sequence of a ``[batch, seq]`` batch (a new one wherever positions restart at 0)."""
        if isinstance(position_ids, torch.Tensor):
            position_ids = position_ids.cpu().numpy()
        return cls(BatchLayout(position_ids).sequence_lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def causal_pairs(self, window: int | None = None) -> int:
        """Query-key pairs that causal attention (limited to ``window`` keys) scores, summed over sequences."""
        lengths = self.lengths
        head = lengths if window is None else np.minimum(lengths, window)
        # query i (from 1) sees min(i, window) keys: 1..head, then ``window`` for each query after the head
        return int((head * (head + 1) // 2 + (lengths - head) * (window or 0)).sum())


@dataclass
class ForwardFlops:
    """Forward FLOPs split by what the backward pass needs: weight matmuls get a weight gradient
    (skipped for frozen weights), activation matmuls (attention scores) never have one to skip."""

    weights: float = 0.0
    activations: float = 0.0

    def __add__(self, other: ForwardFlops) -> ForwardFlops:
        return ForwardFlops(self.weights + other.weights, self.activations + other.activations)

    def training(self, trainable_fraction: float = 1.0) -> float:
        """Forward + backward: input gradients always, weight gradients for the trainable fraction."""
        return (2.0 + trainable_fraction) * self.weights + 3.0 * self.activations


def gqa_attention_flops(cfg: ModelConfig, att: AttentionConfig, seqs: Sequences, window: int | None) -> ForwardFlops:
    q_width, k_width = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    v_width, out_width = att.num_kv_heads * att.value_dim, att.num_heads * att.value_dim
    # q (and its output gate), k, v projections in and the output projection back
    projections = 2 * seqs.tokens * cfg.hidden_size * ((2 if att.output_gate else 1) * q_width + k_width + v_width
                                                       + out_width)
    # QK^T and (softmax)V, every query head, over the causal pairs
    scores = 2 * (q_width + out_width) * seqs.causal_pairs(window)
    return ForwardFlops(weights=projections, activations=scores)


def mla_attention_flops(cfg: ModelConfig, att: AttentionConfig, seqs: Sequences, window: int | None) -> ForwardFlops:
    """Latent attention: queries (through their LoRA bottleneck if any), the shared latent + rotary key, its
    expansion into per-head keys and values, the output projection; scores over nope + rope query/key channels
    and values of ``v_head_dim``."""
    hidden = cfg.hidden_size
    heads, qk_dim = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
    if att.q_lora_rank:
        queries = hidden * att.q_lora_rank + att.q_lora_rank * heads * qk_dim
    else:
        queries = hidden * heads * qk_dim
    latent = hidden * (att.kv_lora_rank + att.qk_rope_head_dim)
    expand = att.kv_lora_rank * heads * (att.qk_nope_head_dim + att.v_head_dim)
    output = heads * att.v_head_dim * hidden
    projections = 2 * seqs.tokens * (queries + latent + expand + output)
    scores = 2 * heads * (qk_dim + att.v_head_dim) * seqs.causal_pairs(window)
    return ForwardFlops(weights=projections, activations=scores)


ATTENTION_FLOPS: dict[str, Callable[[ModelConfig, AttentionConfig, Sequences, int | None], ForwardFlops]] = {
    "gqa": gqa_attention_flops,
    "mla": mla_attention_flops,
}


def attention_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """The ``attention_index``-th attention block (its sliding window and settings may depend on the index)."""
    att = cfg.attention_for(attention_index)
    if att.type not in ATTENTION_FLOPS:
        raise NotImplementedError(f"no FLOPs formula for attention.type {att.type!r} in lightning_moe.models.flops")
    return ATTENTION_FLOPS[att.type](cfg, att, seqs, cfg.attention.window_for(attention_index))


def feed_forward_flops(tokens: int, hidden: int, intermediate: int, activation: str) -> float:
    """A dense feed-forward: gated activations have three projections, squared ReLU two."""
    projections = 2 if activation == "relu2" else 3
    return 2.0 * tokens * hidden * intermediate * projections


def mlp_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    mlp = cfg.mlp
    return ForwardFlops(weights=feed_forward_flops(seqs.tokens, cfg.hidden_size, mlp.intermediate_size, mlp.activation))


def moe_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    moe, hidden, tokens = cfg.moe, cfg.hidden_size, seqs.tokens
    expert_dim = moe.latent_size or hidden
    total = 2.0 * tokens * hidden * moe.num_experts  # router
    total += moe.top_k * feed_forward_flops(tokens, expert_dim, moe.intermediate_size, moe.activation)
    if moe.latent_size:
        total += 2 * (2.0 * tokens * hidden * moe.latent_size)  # into and out of the latent width
    if moe.num_shared_experts:
        total += feed_forward_flops(tokens, hidden, moe.shared_size, moe.activation)
    if moe.shared_expert_gate:
        total += 2.0 * tokens * hidden
    return ForwardFlops(weights=total)


def mamba_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """Mamba-2 mixer. Weights: in/out projections and the depthwise conv (``conv_kernel`` multiply-adds per
    channel). Activations, the chunked SSD scan of each sequence: ``C B^T`` (per group) and its product with
    ``x`` (per head) over the full square of every chunk (a last, partial chunk of ``r`` tokens counts ``r^2``),
    the state each chunk leaves and its read-out by ``C`` (per token), and the decay of states across chunks
    (chunks squared). The gated norm is a norm: not counted."""
    mamba, hidden, tokens = cfg.mamba, cfg.hidden_size, seqs.tokens
    inner, bc = mamba.num_heads * mamba.head_dim, mamba.n_groups * mamba.state_size
    conv_dim = inner + 2 * bc
    weights = 2.0 * tokens * (hidden * (inner + conv_dim + mamba.num_heads) + inner * hidden + mamba.conv_kernel * conv_dim)
    full, rest = seqs.lengths // mamba.chunk_size, seqs.lengths % mamba.chunk_size
    square = int((full * mamba.chunk_size**2 + rest**2).sum())
    chunks = full + (rest > 0)
    scan = 2.0 * square * (bc + inner) + 2 * 2.0 * tokens * inner * mamba.state_size
    scan += 2.0 * int((chunks**2).sum()) * inner * mamba.state_size
    return ForwardFlops(weights=weights, activations=scan)


def delta_rule_flops(cfg: ModelConfig, seqs: Sequences) -> float:
    """The chunked gated delta rule of each sequence, per value head (queries and keys serve every value head
    of their group): per chunk of ``c`` tokens the two decayed products ``k k^T`` and ``q k^T`` (``2 c^2 d_k``
    each), the unit-triangular solve for ``[v | k]`` (the blocked inverse and its product, ``solve_flops``), the
    intra-chunk output (``2 c^2 d_v``); between chunks the state written, and read twice (``3 x 2 c d_k d_v``),
    once per chunk after a sequence's first. A last, partial chunk of ``r`` tokens counts ``r``. Training counts
    three forwards, whatever backward recomputes (``layers/delta_rule.py``), as activation checkpointing does."""
    la = cfg.linear_attention
    dk, dv, chunk = la.head_k_dim, la.head_v_dim, la.chunk_size
    full, rest = seqs.lengths // chunk, seqs.lengths % chunk
    square = int((full * chunk**2 + rest**2).sum())
    solves = int(full.sum()) * solve_flops(chunk, dk + dv) + sum(solve_flops(r, dk + dv) for r in rest.tolist() if r)
    carried = int((np.maximum(full + (rest > 0) - 1, 0) * chunk).sum())  # tokens of chunks that read a state
    per_head = square * (2 * 2 * dk + 2 * dv) + solves + 3 * 2.0 * carried * dk * dv
    return la.num_v_heads * per_head


def gated_deltanet_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """Gated DeltaNet. Weights: q/k/v, z, b and a projections, the out-projection, the depthwise conv
    (``conv_kernel`` multiply-adds per channel). Activations: :func:`delta_rule_flops`."""
    la, hidden = cfg.linear_attention, cfg.hidden_size
    key, value = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
    conv_dim = 2 * key + value
    projections = hidden * (conv_dim + value + 2 * la.num_v_heads) + value * hidden
    weights = 2.0 * seqs.tokens * (projections + la.conv_kernel * conv_dim)
    return ForwardFlops(weights=weights, activations=delta_rule_flops(cfg, seqs))


def kda_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """Kimi Delta Attention. Weights: q/k/v projections, the low-rank forget and output gates, beta, the
    out-projection, the conv. Activations: :func:`delta_rule_flops` (per-channel decays cost the same
    products)."""
    la, hidden = cfg.linear_attention, cfg.hidden_size
    width, dim = la.num_v_heads * la.head_v_dim, la.head_v_dim
    projections = 3 * hidden * width + 2 * (hidden * dim + dim * width) + hidden * la.num_v_heads + width * hidden
    weights = 2.0 * seqs.tokens * (projections + la.conv_kernel * 3 * width)
    return ForwardFlops(weights=weights, activations=delta_rule_flops(cfg, seqs))


BLOCK_FLOPS: dict[str, Callable[[ModelConfig, Sequences, int], ForwardFlops]] = {
    "*": attention_flops,
    "M": mamba_flops,
    "G": gated_deltanet_flops,
    "K": kda_flops,
    "-": mlp_flops,
    "E": moe_flops,
}


def pattern_flops(cfg: ModelConfig, pattern: str, seqs: Sequences, first_attention_index: int = 0) -> ForwardFlops:
    """One block per symbol, attention blocks numbered in pattern order from ``first_attention_index`` (as
    ``build_blocks`` does)."""
    total, attention_index = ForwardFlops(), first_attention_index
    for symbol in pattern:
        if symbol not in BLOCK_FLOPS:
            raise NotImplementedError(
                f"no FLOPs formula for block {symbol!r} ({BLOCK_SYMBOLS.get(symbol, 'unknown')}) "
                "in lightning_moe.models.flops"
            )
        total += BLOCK_FLOPS[symbol](cfg, seqs, attention_index)
        attention_index += symbol == "*"
    return total


def mtp_depths(cfg: ModelConfig) -> int:
    """MTP depths that run (their weights may be kept with ``enabled=False`` and skip all compute)."""
    mtp = cfg.mtp
    return mtp.num_layers if mtp is not None and mtp.enabled else 0


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
    hidden = cfg.hidden_size
    total = pattern_flops(cfg, cfg.pattern, seqs)
    for _ in range(depths):
        total += ForwardFlops(weights=2.0 * seqs.tokens * (2 * hidden) * hidden)  # eh_proj
        total += pattern_flops(cfg, cfg.mtp.pattern, seqs, cfg.pattern.count("*"))
    return total + ForwardFlops(weights=2.0 * hidden * cfg.vocab_size * sum(output_tokens))


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
