"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): projections, causal depthwise conv over ``q | k | v``, L2-normed
queries and keys, the gated delta rule with one decay per value head, a gated RMSNorm per head, out-projection.

Parameter names are Qwen3.5's (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
``dt_bias``, ``A_log``, ``norm``, ``out_proj``); Qwen3-Next's fused ``in_proj_qkvz``/``in_proj_ba`` are a
permutation of the same rows (``families/qwen3_next.py``). Each of ``num_k_heads`` query/key heads serves
``num_v_heads / num_k_heads`` consecutive value heads.

Packed rows: the conv and the delta rule read sequence boundaries from the :class:`SequenceLayout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.config import LinearAttentionConfig
from lightning_moe.models.layers.delta_rule import chunk_gated_delta_rule, fla_gated_delta_rule, l2_normalize
from lightning_moe.models.layers.mamba2 import CausalConv1d
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.upcast import upcast


class HeadGatedRMSNorm(nn.Module):
    """Per head: ``rmsnorm(x) * weight * act(gate)`` (norm before gate). ``silu`` with the weight applied in the
    input dtype (Qwen3-Next), ``sigmoid`` with the weight in fp32 (Kimi-Linear), as their references do."""

    def __init__(self, dim: int, eps: float, activation: str) -> None:
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self, init_std: float | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate`` [..., heads, dim] -> [..., heads, dim] in ``x``'s dtype."""
        normed = F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps)
        if self.activation == "silu":
            return ((self.weight * normed.to(x.dtype)) * F.silu(upcast(gate))).to(x.dtype)
        return (upcast(self.weight) * normed * torch.sigmoid(upcast(gate))).to(x.dtype)


def delta_rule(cfg: LinearAttentionConfig, q, k, v, g, beta, layout: SequenceLayout) -> torch.Tensor:
    """The gated delta rule over normalized ``q``/``k`` by the configured backend, fp32 output."""
    seq_idx = layout.document_ids if layout.packed else None
    if cfg.backend == "fla":
        return upcast(fla_gated_delta_rule(q, k, v, g, beta, layout.cu_seqlens if layout.packed else None))
    return chunk_gated_delta_rule(q, k, v, g, beta, cfg.chunk_size, seq_idx)


class GatedDeltaNet(nn.Module):
    """``forward(x [batch, seq, hidden], layout) -> [batch, seq, hidden]``."""

    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.key_dim = cfg.num_k_heads * cfg.head_k_dim
        self.value_dim = cfg.num_v_heads * cfg.head_v_dim
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, cfg.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, cfg.num_v_heads, bias=False)
        self.conv1d = CausalConv1d(2 * self.key_dim + self.value_dim, cfg.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_v_heads))
        self.norm = HeadGatedRMSNorm(cfg.head_v_dim, cfg.norm_eps, "silu")
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """fla's and transformers' init: A uniform in [0.01, 16], dt_bias = 1; linears normal(init_std)."""
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.out_proj):
            nn.init.normal_(linear.weight, std=init_std)
        self.conv1d.reset_parameters()
        self.norm.reset_parameters()
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(0.01, 16).log())

    @property
    def head_groups(self) -> int:
        """Units the heads split into when ranks share them out (``parallel/mamba.py``)."""
        return self.cfg.num_k_heads

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What the mixer reads of each token: conv input (q | k | v), output gate z, beta logits b, decay input a."""
        return [self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)]

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        return self.out_proj(self.mix(self.project(x), layout).to(x.dtype))

    def group_channels(self, first: int, last: int) -> list[torch.Tensor]:
        """Channels of each part of :meth:`project` that key heads ``[first, last)`` and their value heads read."""
        cfg, device = self.cfg, self.in_proj_b.weight.device
        per = cfg.num_v_heads // cfg.num_k_heads
        k_rows = torch.arange(first * cfg.head_k_dim, last * cfg.head_k_dim, device=device)
        v_rows = torch.arange(first * per * cfg.head_v_dim, last * per * cfg.head_v_dim, device=device)
        heads = torch.arange(first * per, last * per, device=device)
        conv = torch.cat([k_rows, k_rows + self.key_dim, v_rows + 2 * self.key_dim])
        return [conv, v_rows, heads, heads]

    def mix(self, parts: list[torch.Tensor], layout: SequenceLayout, groups: tuple[int, int] | None = None,
            channels: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Conv, delta rule and gated norm of key heads ``groups`` (default: all) and their value heads, from the
        channels ``channels`` (of :meth:`group_channels`) of :meth:`project`'s output; [batch, seq, their values]."""
        cfg = self.cfg
        first, last = groups or (0, cfg.num_k_heads)
        per = cfg.num_v_heads // cfg.num_k_heads
        heads = slice(first * per, last * per)
        qkv, z, b, a = parts
        batch, seq, _ = qkv.shape
        conv = F.silu(self.conv1d(qkv, layout, None if channels is None else channels[0]))
        key_width = (last - first) * cfg.head_k_dim
        q, k, v = conv.split([key_width, key_width, conv.shape[-1] - 2 * key_width], -1)
        q = l2_normalize(upcast(q).view(batch, seq, -1, cfg.head_k_dim)).repeat_interleave(per, dim=2)
        k = l2_normalize(upcast(k).view(batch, seq, -1, cfg.head_k_dim)).repeat_interleave(per, dim=2)
        v = v.view(batch, seq, -1, cfg.head_v_dim)
        beta = torch.sigmoid(upcast(b))
        g = -torch.exp(upcast(self.A_log[heads])) * F.softplus(upcast(a) + upcast(self.dt_bias[heads]))
        out = delta_rule(cfg, q, k, v, g, beta, layout).to(v.dtype)
        return self.norm(out, z.view(batch, seq, -1, cfg.head_v_dim)).flatten(2)

