"""Layout-invariant initialization: the same seed gives the same weights whatever the parallel layout.

Random draws taken on each rank's shard (or on the whole model in parameter order) depend on how the model is
split: a 2-rank FSDP run would start from other weights than one process, and a pipeline stage, which holds only
some blocks, from other weights than the whole model. Here every module that initializes parameters draws from
the generator seeded by ``(seed, module name)``, on whole (global-shape) tensors: a module whose parameters are
DTensor shards gets full-size plain tensors for the duration of its ``reset_parameters``, then each rank keeps its
slice. At most one module's whole parameters exist at a time (the largest: a MoE layer's stacked experts).
Values depend on the device type (CPU and CUDA generators differ), not on the layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed for module ``name`` (a stable hash: the same in every process and Python version)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def local_piece(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The slice of the global tensor ``full`` that the DTensor ``target`` holds on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, local_shape))]


@torch.no_grad()
def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """``target.copy_(full)`` where ``target`` may be a DTensor shard: each rank copies its own slice."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        target.to_local().copy_(local_piece(full, target))
    else:
        target.copy_(full)


@contextmanager
def whole_parameters(module: nn.Module) -> Iterator[None]:
    """Inside, the DTensor parameters of ``module`` (recursively) are whole plain tensors; on exit each rank's
    shards take their slices of them."""
    from torch.distributed.tensor import DTensor

    swapped = []
    for owner in module.modules():
        for leaf, param in owner._parameters.items():
            if isinstance(param, DTensor):
                whole = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                owner._parameters[leaf] = nn.Parameter(whole, requires_grad=False)
                swapped.append((owner, leaf, param, whole))
    try:
        yield
    finally:
        for owner, leaf, param, whole in swapped:
            owner._parameters[leaf] = param
            copy_full_(param, whole)


@torch.no_grad()
def seeded_init(module: nn.Module, name: str, seed: int, init: Callable[[nn.Module], None]) -> None:
    """Run ``init(module)`` on its whole parameters with the generators seeded by ``(seed, name)`` (the caller's
    generator states are restored afterwards)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(module_seed(seed, name))
        with whole_parameters(module):
            init(module)
