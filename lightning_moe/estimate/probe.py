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

from lightning_moe.models.fake_tensors import BalancedShapes


@dataclass
class SavedActivations:
    """Bytes saved for backward, per repeated block (by name) and outside them, and each block's input."""

    per_block: dict[str, int] = field(default_factory=dict)
    block_input: dict[str, int] = field(default_factory=dict)
    outside: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_block.values()) + self.outside


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
            if isinstance(first, torch.Tensor):  # every call's (a shared MTP layer runs once per depth)
                inputs[name] = inputs.get(name, 0) + first.numel() * first.element_size()

        handles.append(block.register_forward_pre_hook(enter))
        def leave(module, args, output):
            current.pop()

        handles.append(block.register_forward_hook(leave))
    try:
        with mode, BalancedShapes(tokens_per_expert), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
