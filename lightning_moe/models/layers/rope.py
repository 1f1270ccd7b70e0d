"""Rotary position embeddings: default, llama3 and yarn frequency schedules, partial and interleaved rotation.

Frequencies are computed on the fly from the config (a few hundred floats), so the module has no buffers
to materialize after meta-device construction.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_moe.models.config import RopeConfig
from lightning_moe.models.layers.upcast import upcast_dtype


def rotary_dim(cfg: RopeConfig, head_dim: int) -> int:
    return int(head_dim * cfg.partial_rotary_factor)


def inverse_frequencies(cfg: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies (fp32, on CPU even under a meta-device context) and the attention
    scaling applied to cos/sin."""
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if cfg.type in ("default", "none"):
        return inv_freq, 1.0
    if cfg.type == "llama3":
        return _llama3(cfg, inv_freq), 1.0
    if cfg.type == "yarn":
        return _yarn(cfg, dim, max_position_embeddings)
    raise ValueError(f"RopeConfig.type={cfg.type!r} is not supported (default, llama3, yarn, none)")


def _llama3(cfg: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    if cfg.original_max_position_embeddings is None:
        raise ValueError("RopeConfig.original_max_position_embeddings is required for llama3 rope scaling")
    old_len = cfg.original_max_position_embeddings
    low_freq_wavelen = old_len / cfg.low_freq_factor
    high_freq_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = cfg.original_max_position_embeddings
    if original is None:
        raise ValueError("RopeConfig.original_max_position_embeddings is required for yarn rope scaling")
    factor = cfg.factor
    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [batch, seq, rotary_dim] for the given position ids."""

    def __init__(self, cfg: RopeConfig, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dim = rotary_dim(cfg, head_dim)
        inv_freq, self.attention_scaling = inverse_frequencies(cfg, self.dim, max_position_embeddings)
        self._inv_freq_cpu = inv_freq
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles (float64 for a float64 model) whatever the activations' dtype, as the references compute them
        freqs = position_ids[..., None].to(upcast_dtype(dtype)) * self.inv_freq(position_ids.device)
        if self.cfg.interleave:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` [batch, seq, heads, head_dim]; pass the rest through."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rotate = _rotate_pairs if interleave else _rotate_half
    if rot == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)
