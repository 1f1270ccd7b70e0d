"""A model built without memory: meta-device construction, then fake CPU tensors (shapes and dtypes only), and
the data-dependent ops of a balanced, fully labelled batch. Used by the memory estimate and the FLOP count of
transformers models."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode


class BalancedShapes(TorchDispatchMode):
    """Data-dependent ops with the shapes of a balanced, fully labelled batch."""

    def __init__(self, tokens_per_expert: int) -> None:
        super().__init__()
        self.tokens_per_expert = tokens_per_expert

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            bins = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.full((bins,), self.tokens_per_expert, dtype=torch.long)
        if func is torch.ops.aten._grouped_mm.default and args[0].dim() == 2 and args[1].dim() == 3:
            # the fake kernel takes bf16 only; fp32 grouped GEMMs run eagerly on CPU
            return torch.empty(args[0].shape[0], args[1].shape[-1], dtype=args[0].dtype)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self.tokens_per_expert  # a host read of a group size (torchao's MXFP8 token-group padding)
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.zeros(x.numel(), x.dim(), dtype=torch.long)
        return func(*args, **kwargs)


def fake_model(build) -> tuple[FakeTensorMode, nn.Module]:
    """``build()`` on the meta device (converters included, as training builds it), then every parameter and
    buffer replaced by a fake CPU tensor of the same shape, dtype and ``requires_grad``: the model, and the
    fake mode to run it in (meta tensors cannot run CPU code paths such as autocast)."""
    with torch.device("meta"):
        model = build()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants built outside the mode (rope tables)
    with mode:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    return mode, model
