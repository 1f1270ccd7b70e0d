"""Forward FLOPs of one block of each kind over a batch's real sequences: the formulas the block records
(``models/blocks.py``) name, summed into a model's training FLOPs by ``models/flops.py`` (its docstring states
the counting conventions). Each takes ``(config, sequences, attention index)``: the index of an attention block
picks its window and settings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.config import ModelConfig
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


def gqa_attention_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """The ``attention_index``-th attention block (its sliding window and settings may depend on the index)."""
    att, window = cfg.attention_for(attention_index), cfg.attention.window_for(attention_index)
    q_width, k_width = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    v_width, out_width = att.num_kv_heads * att.value_dim, att.num_heads * att.value_dim
    # q (and its output gate), k, v projections in and the output projection back
    projections = 2 * seqs.tokens * cfg.hidden_size * ((2 if att.output_gate else 1) * q_width + k_width + v_width
                                                       + out_width)
    # QK^T and (softmax)V, every query head, over the causal pairs
    scores = 2 * (q_width + out_width) * seqs.causal_pairs(window)
    return ForwardFlops(weights=projections, activations=scores)


def mla_attention_flops(cfg: ModelConfig, seqs: Sequences, attention_index: int) -> ForwardFlops:
    """Latent attention: queries (through their LoRA bottleneck if any), the shared latent + rotary key, its
    expansion into per-head keys and values, the output projection; scores over nope + rope query/key channels
    and values of ``v_head_dim``."""
    att, window = cfg.attention_for(attention_index), cfg.attention.window_for(attention_index)
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
