"""Tensor parallelism with sequence parallelism (Megatron-style), as DTensor plans over the decoder's blocks.

Between blocks the residual stream is split along the sequence (``Shard(1)``, sequence parallelism), so norms
and residual adds run on ``seq / tp`` tokens. Entering attention or a dense MLP the tokens are all-gathered;
q/k/v and gate/up are split by output columns (whole heads / intermediate channels per rank), o and down by
input rows, and their partial sums are reduce-scattered back to sequence shards. The embedding is split by
vocabulary rows, and so is the output layer, whose cross entropy is vocabulary-parallel (local log-sum-exp
and target logit, all-reduced), so full-vocabulary logits never exist on one rank.

MoE blocks are not split by channels: each rank routes its own sequence shard through the whole MoE, whose
parameters are replicated over the tensor-parallel ranks and whose gradients are summed over them (every
rank saw different tokens); the load-balancing loss is the mean of the shards' losses, as for micro-batches.
Use expert parallelism to spread the experts' memory.

Supported: GQA/MHA attention (qk-norm, biases, sinks, sliding windows), dense MLPs, MoE, tied or untied
output. Not supported (``ParallelDims.check_model`` says so before anything is built): MLA, Mamba-2, MTP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.layers.loss import OutputLayer, linear_cross_entropy
from lightning_moe.parallel.collectives import all_gather_autograd
from lightning_moe.parallel.local_params import use_local_parameters


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Split ``model`` (a Decoder, still on the meta device) over ``tp_mesh``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
    })
    if model.lm_head is not None:
        # never called as a module: the output layer reads the weight (see VocabParallelOutput)
        model.lm_head.weight = nn.Parameter(distribute_tensor(model.lm_head.weight, tp_mesh, [Shard(0)]))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block))
        if block.symbol == "E":
            _replicate_moe(block.moe, tp_mesh)
        if block.symbol == "*" and getattr(block.attn, "sinks", None) is not None:
            block.attn.sinks = nn.Parameter(distribute_tensor(block.attn.sinks, tp_mesh, [Shard(0)]))
            use_local_parameters(block.attn, names=["sinks"])
    model.output_layer = VocabParallelOutput(tp_mesh)


def _block_plan(block: nn.Module) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"norm": SequenceParallel(use_local_output=True)}
    if block.symbol == "*":
        plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"attn.{name}"] = ColwiseParallel()
        plan["attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        if block.attn.cfg.qk_norm:
            # per-head norms over local heads; the weight is shared by all heads, so its gradient is summed
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    elif block.symbol == "-":
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        if block.mlp.activation == "swiglu":
            plan["mlp.gate_proj"] = ColwiseParallel()
        plan["mlp.up_proj"] = ColwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _replicate_moe(moe: nn.Module, tp_mesh) -> None:
    """The MoE runs on this rank's sequence shard with replicated weights whose gradients sum over ``tp``."""
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    for owner in list(moe.modules()):
        for leaf, param in list(owner._parameters.items()):
            if param is not None:
                replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                owner._parameters[leaf] = nn.Parameter(replicated, requires_grad=param.requires_grad)
    use_local_parameters(moe, grad_placements=[Partial()])
    moe.register_forward_hook(_average_aux_loss_over(tp_mesh.get_group()))


def _average_aux_loss_over(group):
    """Each rank's load-balancing loss covers its sequence shard: make it the mean over the shards (the same
    value on every rank, as the main loss is) whose gradient is this shard's share of the mean's gradient."""
    import torch.distributed as dist

    def average(moe, args, output):
        if moe.aux_loss is not None:
            share = moe.aux_loss / dist.get_world_size(group)
            mean = share.detach().clone()
            dist.all_reduce(mean, group=group)
            moe.aux_loss = share + (mean - share.detach())
        return output

    return average


class VocabParallelOutput(OutputLayer):
    """The output layer over a vocabulary split by rows across ``tp_mesh``, fed by sequence-parallel hidden
    states: they are all-gathered along the sequence (the backward reduce-scatters, summing each rank's
    partial input gradient), multiplied by the local rows, and reduced Megatron-style."""

    def __init__(self, tp_mesh) -> None:
        self.mesh = tp_mesh
        self.group = tp_mesh.get_group()

    def _full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_autograd(hidden, 1, self.group)

    def _local_rows(self, weight) -> tuple[torch.Tensor, int]:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return weight.to_local(), offset[0]

    def logits(self, hidden: torch.Tensor, weight) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        local_weight, _ = self._local_rows(weight)
        local_logits = F.linear(self._full_sequence(hidden), local_weight)
        return DTensor.from_local(local_logits, self.mesh, [Shard(-1)]).full_tensor()

    def loss(self, hidden: torch.Tensor, weight, labels: torch.Tensor,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        local_weight, start = self._local_rows(weight)
        return linear_cross_entropy(self._full_sequence(hidden), local_weight, labels, chunk_size,
                                    vocab_group=self.group, vocab_start=start)


def sum_partial_gradients(model: nn.Module) -> None:
    """Without FSDP (which does it while reducing), turn the partial gradients of replicated DTensor
    parameters (norms under sequence parallelism, MoE weights) into their sums as soon as they are
    accumulated, so optimizers and clipping see plain replicated gradients."""
    from torch.distributed.tensor import DTensor

    def redistribute(param) -> None:
        if param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and any(p.is_replicate() for p in param.placements):
            param.register_post_accumulate_grad_hook(redistribute)
