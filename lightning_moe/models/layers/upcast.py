"""The dtype the layers upcast to for accuracy: float32, or float64 for float64 inputs.

Norms, routers, mixer scans and the loss compute in fp32 whatever the parameter dtype, as the Hugging Face
references do. Given float64 they stay in float64 instead, so a float64 model is float64 throughout: the tests
compare it with a float64 reference far from any rounding, which an fp32 upcast would cap at fp32 accuracy.
"""

from __future__ import annotations

import torch


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`upcast_dtype` of its own dtype (a no-op for fp32 and float64 tensors)."""
    return x.to(upcast_dtype(x.dtype))
