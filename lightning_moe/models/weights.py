"""Put full tensors into a model: assigned into a fresh one built on the meta device, or copied into a
materialized one whose parameters may be DTensor shards (each rank keeps its slice)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_moe.models.seeded_init import copy_full_


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def assign_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> None:
    """Replace meta parameters/buffers by checkpoint tensors (parameters take ``dtype`` when given, buffers keep
    the checkpoint's dtype); non-persistent buffers still on meta are running state and start at zero."""
    for name, tensor in tensors:
        module, leaf = _owner(model, name)
        tensor = tensor.to(device)
        if leaf in module._parameters:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
        else:
            module._buffers[leaf] = tensor
    for module in model.modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[leaf] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)


@torch.no_grad()
def copy_tensors_into(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy full checkpoint tensors into a materialized model whose parameters may be DTensor shards:
    each rank keeps only its own slice. Returns the number of tensors copied."""
    state = model.state_dict(keep_vars=True)
    # adapters (peft LoRA) keep a wrapped layer's own weights under ``base_layer``; checkpoints use plain names
    state.update({name.replace(".base_layer.", "."): t for name, t in state.items() if ".base_layer." in name})
    count = 0
    for name, full in tensors:
        if name not in state:
            raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the model")
        target = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(full.shape)}, the model has {tuple(target.shape)}")
        copy_full_(target, full)
        count += 1
    return count
