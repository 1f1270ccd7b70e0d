"""Kimi Delta Attention mixer (Kimi-Linear): the gated delta rule with one forget gate per key channel.

``q_proj``/``k_proj``/``v_proj``, a causal depthwise conv over ``q | k | v`` (the hub stores it as three convs),
L2-normed queries and keys, a low-rank forget gate (``f_a_proj`` -> ``f_b_proj``, ``dt_bias`` per channel,
``A_log`` per head), ``beta = sigmoid(b_proj)``, a low-rank output gate (``g_a_proj`` -> ``g_b_proj``) through
a sigmoid-gated RMSNorm per head, and ``out_proj`` (the hub's ``o_proj``). Other names are the hub's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.config import LinearAttentionConfig
from lightning_moe.models.layers.delta_rule import l2_normalize
from lightning_moe.models.layers.gated_deltanet import HeadGatedRMSNorm, delta_rule
from lightning_moe.models.layers.mamba2 import CausalConv1d
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.upcast import upcast


class KimiDeltaAttention(nn.Module):
    """``forward(x [batch, seq, hidden], layout) -> [batch, seq, hidden]``."""

    def __init__(self, cfg: LinearAttentionConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        heads, dim = cfg.num_v_heads, cfg.head_v_dim
        width = heads * dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.conv1d = CausalConv1d(3 * width, cfg.conv_kernel, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, dim, bias=False)
        self.f_b_proj = nn.Linear(dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.b_proj = nn.Linear(hidden_size, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, dim, bias=False)
        self.g_b_proj = nn.Linear(dim, width, bias=False)
        self.o_norm = HeadGatedRMSNorm(dim, cfg.norm_eps, "sigmoid")
        self.out_proj = nn.Linear(width, hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """fla's init: A uniform in [1, 16], softplus(dt_bias) log-uniform in [1e-3, 0.1]; linears normal(init_std)."""
        for module in self.children():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
        self.conv1d.reset_parameters()
        self.o_norm.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        low, high = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand_like(self.dt_bias, dtype=torch.float32) * (high - low) + low).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus

    @property
    def head_groups(self) -> int:
        """Units the heads split into when ranks share them out (``parallel/mamba.py``)."""
        return self.cfg.num_v_heads

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What the mixer reads of each token: conv input (q | k | v), forget-gate input, beta logits, output gate."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return [qkv, self.f_b_proj(self.f_a_proj(x)), self.b_proj(x), self.g_b_proj(self.g_a_proj(x))]

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        return self.out_proj(self.mix(self.project(x), layout).to(x.dtype))

    def group_channels(self, first: int, last: int) -> list[torch.Tensor]:
        """Channels of each part of :meth:`project` that heads ``[first, last)`` read."""
        dim, width, device = self.cfg.head_v_dim, self.q_proj.weight.shape[0], self.b_proj.weight.device
        rows = torch.arange(first * dim, last * dim, device=device)
        return [torch.cat([rows, rows + width, rows + 2 * width]), rows, torch.arange(first, last, device=device), rows]

    def mix(self, parts: list[torch.Tensor], layout: SequenceLayout, groups: tuple[int, int] | None = None,
            channels: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Conv, delta rule and gated norm of heads ``groups`` (default: all) from the channels ``channels`` (of
        :meth:`group_channels`) of :meth:`project`'s output; [batch, seq, their channels]."""
        cfg = self.cfg
        first, last = groups or (0, cfg.num_v_heads)
        qkv, f, b, gate = parts
        batch, seq, _ = qkv.shape
        shape = (batch, seq, last - first, cfg.head_v_dim)
        conv = F.silu(self.conv1d(qkv, layout, None if channels is None else channels[0]))
        q, k, v = (t.reshape(shape) for t in conv.chunk(3, dim=-1))
        q, k = l2_normalize(upcast(q)), l2_normalize(upcast(k))
        dt_bias = self.dt_bias if channels is None else self.dt_bias.index_select(0, channels[1])
        g = -torch.exp(upcast(self.A_log[first:last]))[:, None] * F.softplus(upcast(f) + upcast(dt_bias)).view(shape)
        out = delta_rule(cfg, q, k, v, g, torch.sigmoid(upcast(b)), layout).to(v.dtype)
        return self.o_norm(out, gate.view(shape)).flatten(2)
