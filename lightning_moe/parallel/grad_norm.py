"""Gradient norm and clipping over parameters that live on different device meshes.

Dense parameters are DTensors on the data/tensor-parallel meshes, experts on the expert mesh; one
``torch.nn.utils.clip_grad_norm_`` call cannot mix them. The norm is computed per (mesh, placements) group,
where DTensor reduces each group's shards correctly (summing over sharded dimensions, not over replicated
ones), and the group norms are combined on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    stage_group=None, uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale gradients so that their total ``norm_type`` norm is at most ``max_norm``; returns the norm
    before clipping (a plain tensor, equal on every rank). ``stage_group``: the pipeline ranks, whose
    parameters are different blocks of the same model (their norms are combined too); ``uncounted``: this
    rank's copies of weights another pipeline rank holds and counts (tied embeddings), scaled but not counted."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not grads and stage_group is None:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = {}
    skip = {id(p) for p in uncounted}
    for grad in [p.grad for p in parameters if id(p) not in skip]:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else (None, grad.device)
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type) if norms else torch.zeros(())
    if stage_group is not None:
        import torch.distributed as dist

        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=stage_group)
        else:
            total = total.double() ** norm_type
            dist.all_reduce(total, group=stage_group)
            total = (total ** (1.0 / norm_type)).float()
    if max_norm != float("inf"):
        # a factor of at most 1, applied on the device (1 leaves a gradient as it is): nothing is read back
        scale_gradients(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def scale_gradients(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient (of a DTensor: its local shard) in place by the 0-d tensor ``factor``, which stays
    on the device: one fused call per device."""
    from torch.distributed.tensor import DTensor

    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        by_device.setdefault(local.device, []).append(local)
    for device, group in by_device.items():
        torch._foreach_mul_(group, factor.to(device, non_blocking=True))
