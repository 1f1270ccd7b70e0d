"""RMSNorm, computed in fp32 and cast back, as the Hugging Face reference models do."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight_fp32``: multiply by the weight in fp32 and cast the product (GPT-OSS, Nemotron-H), instead of
    casting first (Llama and most others); the two differ only below fp32. ``offset``: scale by ``1 + weight``
    in fp32, the weight initialized to zero (Qwen3-Next, Qwen3.5)."""

    def __init__(self, dim: int, eps: float = 1e-6, weight_fp32: bool = False, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_fp32 = weight_fp32
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self, init_std: float | None = None) -> None:
        (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in fp32, multiply by the weight in the input dtype (bitwise what HF does)
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)
