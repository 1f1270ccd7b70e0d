"""Grouped-query attention with ``sdpa``, ``flex`` and ``te`` (Transformer Engine, ``layers/te.py``) backends.

``flex`` runs torch's compiled flex_attention only where its first use on this machine passed a check against
SDPA with the same mask (``lightning_moe/kernels/flex.py``); elsewhere it takes the ``sdpa`` path.

Packed rows: the decoder builds one :class:`~lightning_moe.models.layers.sequence.SequenceLayout` per forward
from ``position_ids``; every backend gets its masks from it, so no token attends across a sequence boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.kernels.flex import flex_usable, run_flex
from lightning_moe.models.config import AttentionConfig
from lightning_moe.models.layers.norm import RMSNorm
from lightning_moe.models.layers.rope import RotaryEmbedding, apply_rotary
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.te import require_transformer_engine, te_attention
from lightning_moe.models.layers.upcast import upcast


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    *,
    backend: str,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, dim] tensors (k/v may have fewer heads: GQA).

    ``sinks`` [heads] are extra logits that join every row's softmax without a value (GPT-OSS).
    """
    if layout.context_parallel is not None:
        # the row is split over context-parallel ranks: attend over all of its keys, masked by global position
        k, v, layout = layout.context_parallel.gather(k, v)
    if backend == "flex":
        if flex_usable(q, k, v, layout, window, scale, lse=sinks is not None):
            out, lse = run_flex(q, k, v, layout.block_mask(window), scale, lse=sinks is not None)
            return out if sinks is None else _apply_sinks(out, lse, sinks)
        backend = "sdpa"  # the compiled kernel failed its first-use check on this machine (warned once)
    if backend == "sdpa":
        mask = layout.dense_mask(window)
        if sinks is not None:
            return _eager_with_sinks(q, k, v, layout.dense_mask(window, force=True), scale, sinks)
        v_dim = v.shape[-1]
        if q.device.type == "cpu" and v_dim < q.shape[-1] and torch.backends.cuda.flash_sdp_enabled():
            # MLA: CPU SDPA takes its flash kernel only for equal head dims (else the math path, which
            # materializes the seq x seq scores); zero value channels leave the first v_dim output channels and
            # every gradient as they were. (The flag, despite its name, is the global one CPU's choice reads:
            # with flash disabled, e.g. sdpa_kernel(MATH), padding would only add work.)
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out[..., :v_dim]
    if backend == "te":
        if sinks is not None:
            raise ValueError("attention backend 'te' with attention sinks (GPT-OSS) is not supported; use flex or sdpa")
        return te_attention(q, k, v, layout, scale, window)
    raise ValueError(f"attention backend {backend!r} is not supported (sdpa, flex, te)")


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    # softmax over [scores, sink] = softmax(scores) * sum(exp(scores)) / (sum(exp(scores)) + exp(sink))
    weight = torch.sigmoid(upcast(lse) - upcast(sinks)[None, :, None])
    return (upcast(out) * weight[..., None]).to(out.dtype)


def _eager_with_sinks(q, k, v, mask, scale, sinks):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(upcast(torch.cat([scores, sink], dim=-1)), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads, optional qk-norm, biases, sinks, sliding window, value
    heads narrower than the query/key heads and scaled values (MiMo-V2)."""

    def __init__(self, cfg: AttentionConfig, hidden_size: int, max_position_embeddings: int,
                 norm_eps: float, window: int | None = None, norm_offset: bool = False) -> None:
        super().__init__()
        if cfg.backend == "te":
            require_transformer_engine("attention backend 'te'")
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.value_dim = cfg.value_dim
        self.window = window
        self.scale = cfg.softmax_scale or self.head_dim**-0.5
        # output_gate: each head's rows of q_proj are [query | gate]
        q_width = cfg.num_heads * cfg.head_dim * (2 if cfg.output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden_size, cfg.num_kv_heads * self.value_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * self.value_dim, hidden_size, bias=cfg.out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, norm_eps, offset=norm_offset)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.sinks else None
        self.rotary = (
            RotaryEmbedding(cfg.rope, cfg.head_dim, max_position_embeddings) if cfg.rope.type != "none" else None
        )

    def reset_parameters(self, init_std: float = 0.02) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, std=init_std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        batch, seq, _ = x.shape
        # heads may be sharded by tensor parallelism: infer them from the local projection width
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        gate = None
        if self.cfg.output_gate:
            q, gate = q.unflatten(2, (-1, 2)).unbind(3)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.value_dim)
        if self.cfg.value_scale != 1.0:
            v = v * self.cfg.value_scale
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = self.rotary(layout.position_ids, q.dtype)
            q = apply_rotary(q, cos, sin, self.cfg.rope.interleave)
            k = apply_rotary(k, cos, sin, self.cfg.rope.interleave)
        out = attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout,
            backend=self.cfg.backend, scale=self.scale, window=self.window, sinks=self.sinks,
        ).transpose(1, 2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, seq, -1))
