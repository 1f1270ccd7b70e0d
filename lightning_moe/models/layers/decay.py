"""Log-decay between every pair of positions, as the chunked scans (Mamba-2's SSD, the delta rules) mask and
exponentiate it."""

from __future__ import annotations

import torch


def pairwise_decay(log_decay: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log_decay[i] - log_decay[j]`` for every pair of positions ``(i, j)`` along ``dim`` (negative), which
    becomes two dims: [..., L] -> [..., L, L] for ``dim=-1``, [..., L, d] -> [..., L, L, d] for ``dim=-2``.

    Written ``a + (-b)``, bitwise the difference: autograd then negates the gradient of ``log_decay`` itself,
    where ``a - b`` would negate the pairwise one, a pass over the [.., L, L] tensor more."""
    if dim >= 0:
        raise ValueError(f"pairwise_decay counts dim from the end (got dim={dim})")
    return log_decay.unsqueeze(dim) + (-log_decay).unsqueeze(dim - 1)
