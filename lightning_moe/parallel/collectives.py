"""Autograd-aware collectives shared by the parallelisms, in one place because torch renames them."""

from __future__ import annotations

import torch


def all_gather_autograd(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank of ``group`` along ``dim``; the backward sums the gradients
    over the group and keeps this rank's slice (a reduce-scatter)."""
    from torch.distributed import _functional_collectives as funcol

    # torch >= 2.10 name; older versions only have the *_tensor_autograd spelling
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor.contiguous(), dim, group)


def reduce_scatter_autograd(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's slice along ``dim``; the backward all-gathers."""
    from torch.distributed import _functional_collectives as funcol

    scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
    return scatter(tensor.contiguous(), "sum", dim, group)


def all_to_all_autograd(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows ``input_splits[r]`` of ``tensor`` go to rank ``r`` of ``group``; ``output_splits[r]`` rows arrive from
    it. The backward sends the gradients back the same way."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(tensor, output_splits, input_splits, group)
