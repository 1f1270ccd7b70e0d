"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).

Keys and values are rebuilt per head from a small shared latent (``kv_lora_rank``) plus one rotary key
(``qk_rope_head_dim``) shared by all heads; queries optionally pass through their own low-rank bottleneck
(``q_lora_rank``). Each head attends with ``qk_nope_head_dim + qk_rope_head_dim`` query/key channels and
``v_head_dim`` value channels, through the same :func:`attend` as GQA, so packed rows and every backend's
masking behave identically.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.models.config import AttentionConfig
from lightning_moe.models.layers.attention import attend
from lightning_moe.models.layers.norm import RMSNorm
from lightning_moe.models.layers.rope import RotaryEmbedding, _yarn_mscale, apply_rotary
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.te import require_transformer_engine


def mla_softmax_scale(cfg: AttentionConfig) -> float:
    """DeepSeek's scale: ``1/sqrt(qk_head_dim)``, times ``mscale(factor, mscale_all_dim)**2`` under yarn
    scaling (the long-context temperature correction lives in the softmax, not only in cos/sin)."""
    if cfg.softmax_scale is not None:
        return cfg.softmax_scale
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.type == "yarn" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MLA(nn.Module):
    """Latent attention with the constructor and forward contract of :class:`~.attention.Attention`."""

    def __init__(self, cfg: AttentionConfig, hidden_size: int, max_position_embeddings: int,
                 norm_eps: float, window: int | None = None) -> None:
        super().__init__()
        if cfg.kv_lora_rank <= 0 or cfg.qk_rope_head_dim <= 0 or cfg.v_head_dim <= 0:
            raise ValueError(
                "ModelConfig.attention (type='mla'): kv_lora_rank, qk_rope_head_dim and v_head_dim must be > 0, got "
                f"{cfg.kv_lora_rank}, {cfg.qk_rope_head_dim}, {cfg.v_head_dim}"
            )
        if cfg.backend == "te":
            require_transformer_engine("attention backend 'te'")
        self.cfg = cfg
        self.window = window
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        heads = cfg.num_heads
        # the latent norms' own epsilon where the hub fixes it (Kimi-Linear: transformers' default 1e-6)
        latent_eps = cfg.latent_norm_eps if cfg.latent_norm_eps is not None else norm_eps
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden_size, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, heads * self.qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, cfg.kv_lora_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden_size, bias=cfg.out_bias)
        # rope type "none": the rope channels carry no position (Kimi-Linear's NoPE MLA)
        self.rotary = RotaryEmbedding(cfg.rope, self.rope_dim, max_position_embeddings) if cfg.rope.type != "none" else None

    def reset_parameters(self, init_std: float = 0.02) -> None:
        for module in self.children():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank:
            return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        batch, seq, _ = x.shape
        # heads may be sharded by tensor parallelism: infer them from the local projection width
        q = self.queries(x).view(batch, seq, -1, self.qk_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)
        if self.rotary is not None:
            cos, sin = self.rotary(layout.position_ids, q.dtype)
            interleave = self.cfg.rope.interleave
            q_rope = apply_rotary(q_rope, cos, sin, interleave)
            k_rope = apply_rotary(k_rope, cos, sin, interleave)
        k_rope = k_rope.expand(-1, -1, k_nope.shape[2], -1)  # one rope key for all heads
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout,
            backend=self.cfg.backend, scale=self.scale, window=self.window,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
