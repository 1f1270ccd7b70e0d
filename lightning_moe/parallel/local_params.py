"""Let a module whose forward does plain-tensor math (grouped GEMMs, sorting, scatter) own DTensor parameters.

Expert- and tensor-parallel code keeps parameters as DTensors so that checkpoints, FSDP and gradient clipping
know their global shape and placement, but the MoE and attention forwards mix them with local activations.
For the duration of the module's forward, each DTensor parameter is swapped for ``param.to_local()``; the
``grad_placements`` say what the local gradient is: ``Partial()`` on a mesh dimension where every rank saw
different tokens with the same weights, so the gradients are summed across it. FSDP2 swaps parameters the
same way around its own groups, which enclose these swaps.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def use_local_parameters(module: nn.Module, grad_placements: Sequence | None = None,
                         names: Sequence[str] | None = None) -> None:
    """The DTensor parameters of ``module`` (all, recursively, or the direct ones in ``names``) are seen as
    their local tensors inside ``forward``."""
    if names is None:
        owners = [(owner, leaf) for owner in module.modules() for leaf, p in owner._parameters.items() if p is not None]
    else:
        owners = [(module, leaf) for leaf in names]
    saved: list = []

    def swap_in(mod, args):
        from torch.distributed.tensor import DTensor

        for owner, leaf in owners:
            param = owner._parameters[leaf]
            saved.append(param)
            if isinstance(param, DTensor):
                owner._parameters[leaf] = param.to_local(grad_placements=grad_placements)

    def swap_out(mod, args, output):
        for (owner, leaf), param in zip(owners, saved):
            owner._parameters[leaf] = param
        saved.clear()
        return output

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)

