"""RMSNorm, computed in fp32 (float64 for float64 inputs) and cast back, as the Hugging Face reference models do.

Backward keeps only the input and its per-row ``rstd`` (:class:`_RMSNormFunction`) and recomputes the normalized
rows: autograd through the same expression would also keep the fp32 copy of a bf16 input and the normalized rows,
two more [tokens, hidden] tensors per norm. DTensor inputs (sequence parallelism) take the autograd expression,
whose weight gradient DTensor reduces to the weight's placement.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.models.layers.upcast import upcast


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x * rstd`` and ``rstd`` [..., 1]: the expression ``F.rms_norm`` computes, bitwise."""
    xf = upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def _scaled(normed: torch.Tensor, weight: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """How the weight meets the normalized rows: ``"input"`` multiplies in the input dtype after the cast (Llama
    and most others), ``"fp32"`` multiplies in fp32 and casts the product (GPT-OSS, Nemotron-H), ``"offset"``
    scales by 1 + weight in fp32 (Qwen3-Next, Qwen3.5)."""
    if form == "offset":
        return (normed * (1.0 + upcast(weight))).to(dtype)
    if form == "fp32":
        return (upcast(weight) * normed).to(dtype)
    return weight * normed.to(dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, form):
        normed, rstd = _normalized(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.form = form
        return _scaled(normed, weight, form, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = upcast(x) * rstd
        grad = upcast(grad)
        scale = 1.0 + upcast(weight) if ctx.form == "offset" else upcast(weight)
        grad_weight = (grad * normed).flatten(0, -2).sum(0).to(weight.dtype)
        grad_normed = grad * scale
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


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

    @property
    def form(self) -> str:
        return "offset" if self.offset else "fp32" if self.weight_fp32 else "input"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor) or isinstance(self.weight, DTensor):
            return _scaled(_normalized(x, self.eps)[0], self.weight, self.form, x.dtype)
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.form)
