"""What autograd keeps for backward: one forward of the real model, at the real sizes, on fake tensors.

The model is built under ``FakeTensorMode`` (shapes and dtypes only, nothing allocated) and run once on a
micro-batch of the rank's tokens. Every tensor saved for backward passes through a saved-tensor hook that
adds its storage's bytes to the block running at the time (each storage once; parameters, which are not
activations, are left out). The result is exact for the package's own layers, whatever they save, so the
estimate follows the code instead of a formula that would drift from it.

Data-dependent shapes are decided the way a benchmark runs: every label counts (``nonzero`` keeps all rows)
and routing is balanced (``bincount`` returns equal counts), so the probe needs no real data. The model runs
in the compute dtype (FSDP's ``param_dtype`` where set), as its activations are.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class _BalancedShapes(TorchDispatchMode):
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


@dataclass
class SavedActivations:
    """Bytes saved for backward, per repeated block (by name) and outside them, and each block's input."""

    per_block: dict[str, int] = field(default_factory=dict)
    block_input: dict[str, int] = field(default_factory=dict)
    outside: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_block.values()) + self.outside


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


def saved_activations(mode: FakeTensorMode, model: nn.Module, blocks: list[tuple[str, nn.Module]],
                      micro_batch: int, seq_len: int, tokens_per_expert: int) -> SavedActivations:
    """Run ``model(input_ids, labels=...)`` on a fake ``[micro_batch, seq_len]`` batch and attribute the saved
    bytes to ``blocks`` (name, module): what a training step holds at the start of its backward."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen: set[StorageWeakRef] = set()
    current: list[str] = []
    by_block: dict[str, int] = defaultdict(int)
    inputs: dict[str, int] = {}
    outside = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params and ref not in seen:
            seen.add(ref)
            size = tensor.untyped_storage().nbytes()
            if current:
                by_block[current[-1]] += size
            else:
                outside += size
        return tensor

    handles = []
    for name, block in blocks:
        def enter(module, args, name=name):
            current.append(name)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):
                inputs[name] = first.numel() * first.element_size()

        handles.append(block.register_forward_pre_hook(enter))
        def leave(module, args, output):
            current.pop()

        handles.append(block.register_forward_hook(leave))
    try:
        with mode, _BalancedShapes(tokens_per_expert), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            model(ids, None, labels=ids)
    finally:
        for handle in handles:
            handle.remove()
    return SavedActivations(per_block={name: by_block.get(name, 0) for name, _ in blocks},
                            block_input=inputs, outside=outside)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
