"""FSDP2 / HSDP: ``fully_shard`` per block, per MTP depth and on the root, with experts on their own mesh.

Dense parameters are sharded over ``dp_shard x cp`` (context-parallel ranks hold different tokens, so they
are data parallel for the weights), replicated over ``dp_replicate`` for HSDP. Gradients come out as the
mean over those ranks of each rank's gradient of its local loss, which is what the training module expects.

Under expert parallelism the experts are sharded by FSDP only over ``ep_shard`` (the ``ep`` ranks already
hold different experts), but the gradient each rank computes for its experts sums the contributions of
tokens from all ``ep`` ranks. Dividing by the whole ``dp x cp`` size (instead of FSDP's default, the
expert mesh size) keeps the same mean convention as the dense parameters, as torchtitan does.

With gradient accumulation under HSDP, :func:`deferred_all_reduce` leaves the all-reduce across replicas to
the last micro-batch of a step (the reduce-scatter inside a replica still runs on every micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_moe.parallel.activation_checkpoint import repeated_blocks


def apply_fsdp(
    model: nn.Module,
    mesh,
    expert_mesh=None,
    split_experts: Callable[[nn.Module], list[nn.Module]] | None = None,
    *,
    gradient_divide_factor: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> None:
    """Shard ``model`` (its repeated blocks, then the root) over ``mesh`` (1-D FSDP or 2-D ``(replicate, shard)`` HSDP).

    ``expert_mesh``: where the experts that expert parallelism split (``split_experts(block)``, the model kind's)
    are sharded;
    ``gradient_divide_factor``: the ``dp x cp`` size their gradient sums are divided by.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if cpu_offload and mesh.device_type == "cpu":
        raise ValueError("cpu_offload=True offloads accelerator memory to the host; with accelerator=cpu the "
                         "parameters are in host memory already: use cpu_offload=False")
    options = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }
    for _, unit in repeated_blocks(model):
        if expert_mesh is not None:
            for experts in split_experts(unit):
                fully_shard(experts, mesh=expert_mesh, **options)
                _divide_gradients_by(experts, gradient_divide_factor, expert_mesh)
        fully_shard(unit, mesh=mesh, **options)
    # the root group holds the embedding, the final norm and the output weight, which the decoder reads
    # directly (not through a submodule call); it stays unsharded from forward to backward
    fully_shard(model, mesh=mesh, **{**options, "reshard_after_forward": False})
    model.register_forward_hook(_reshard_without_backward)


def _reshard_without_backward(model, args, output):
    # after a forward without autograd (validation) no backward reshards the root: left gathered, the module
    # would expose the gathered copies as its parameters, and an optimizer or checkpoint built from
    # ``parameters()`` / ``state_dict()`` then would hold copies that the next step discards
    if not torch.is_grad_enabled():
        model.reshard()
    return output


def _divide_gradients_by(module, factor: int, mesh) -> None:
    import torch.distributed as dist

    module.set_gradient_divide_factor(float(factor))
    shard_group = mesh.get_group(mesh.ndim - 1)
    if dist.get_backend(shard_group) == "gloo" and shard_group.size() > 1:
        # gloo has no pre-multiplied sum: reduce with a plain sum, then divide
        module.set_force_sum_reduction_for_comms(True)


@contextmanager
def deferred_all_reduce(model: nn.Module) -> Iterator[None]:
    """Backward passes run inside skip HSDP's all-reduce across replicas, for the micro-batches before the last
    of an optimizer step. Each is still reduce-scattered inside its replica (gradients stay sharded); FSDP
    keeps the partial sums and adds them into the next backward that all-reduces, so ``param.grad`` is
    written only then. An FSDP group that got gradients from a deferred backward must get some from that
    last one too (always the case when every micro-batch runs the whole model)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for group in groups:
        group.set_requires_all_reduce(False, recurse=False)
    try:
        yield
    finally:
        for group in groups:
            group.set_requires_all_reduce(True, recurse=False)
