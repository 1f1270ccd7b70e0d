"""Expert parallelism: each rank of the ``ep`` mesh holds ``num_experts / ep`` experts; tokens travel to them.

The MoE module keeps its interface; only two things change:

* the stacked expert weights become DTensors ``Shard(0)`` over ``ep`` (checkpoints and FSDP still see the
  global ``[E, out, in]`` tensors) and the grouped GEMM runs on the local experts;
* ``MoE.dispatcher`` becomes an :class:`AllToAllDispatcher`: token copies sorted by expert are exchanged
  with an all-to-all of variable sizes (the counts go first), run through the local experts grouped by
  expert, and sent back by the reverse all-to-all before the usual weighted combine.

Every rank takes part in both all-to-alls, forward and backward, even when it sends or receives no token,
so skewed routing cannot hang a step. Other dispatchers (DeepEP on GPUs) plug in through
``apply_expert_parallel(..., dispatcher=...)``: any object with the ``TokenDispatcher`` interface.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.models.layers.moe import MoE, Routing, TokenDispatcher
from lightning_moe.models.layers.mtp import MultiTokenPrediction
from lightning_moe.parallel.collectives import all_to_all_autograd
from lightning_moe.parallel.local_params import use_local_parameters


class AllToAllDispatcher(TokenDispatcher):
    """Sends each token copy to the rank that owns its expert (experts ``[r * local, (r + 1) * local)`` on
    rank ``r`` of ``group``) and brings the expert outputs back."""

    def __init__(self, group, num_local_experts: int) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.num_local_experts = num_local_experts
        # the splits of this step's forwards, in order, for the recomputation of checkpointed forwards
        self._kept: deque = deque()
        # off for a layer that runs several times per forward (a shared MTP layer): its recomputations come in
        # reverse order within a micro-batch but in forward order across a pipeline's micro-batches, so they
        # exchange and read their splits again
        self.keep_splits = True

    @torch.compiler.disable  # host bookkeeping: compiled blocks call it eagerly
    def _splits(self, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """``received`` ([ranks, local experts]: rows that rank r sends to local expert e of this rank) and the
        send / receive split sizes, read to the host: all-to-all-v needs them there, one host sync per forward
        for both. Activation checkpointing runs the forward again during backward, on the same tokens: that
        recomputation takes the splits its forward kept (forwards are recomputed in the order they ran) instead of
        exchanging and reading them again."""
        recomputing = torch._C._current_graph_task_id() != -1
        if recomputing and self._kept:
            return self._kept.popleft()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ranks, self.num_local_experts)
        sent = counts.view(self.ranks, self.num_local_experts).sum(dim=1)
        send_splits, recv_splits = torch.stack([sent, received.sum(dim=1)]).tolist()
        if self.keep_splits and torch.is_grad_enabled() and not recomputing:
            self._kept.append((received, send_splits, recv_splits))
        return received, send_splits, recv_splits

    def end_step(self) -> None:
        """The optimizer step is over: forwards that were not checkpointed leave their splits unused."""
        self._kept.clear()

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int):
        sorted_x, counts, local_state = super().dispatch(x, routing, num_experts)
        received, send_splits, recv_splits = self._splits(counts)
        arrived = all_to_all_autograd(sorted_x, recv_splits, send_splits, self.group)
        # rows arrive grouped by source rank, then expert: regroup them by expert for the grouped GEMM
        expert_of_row = torch.arange(self.num_local_experts, device=x.device).repeat(self.ranks)
        expert_of_row = torch.repeat_interleave(expert_of_row, received.flatten(), output_size=sum(recv_splits))
        by_expert = torch.argsort(expert_of_row, stable=True)
        state = (local_state, by_expert, send_splits, recv_splits)
        return arrived[by_expert], received.sum(dim=0), state

    def copied_from(self, state) -> None:
        return None  # the rows came from other ranks

    def combine(self, out: torch.Tensor, routing: Routing, state) -> torch.Tensor:
        local_state, by_expert, send_splits, recv_splits = state
        by_source = torch.empty_like(by_expert)
        by_source[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        returned = all_to_all_autograd(out[by_source], send_splits, recv_splits, self.group)
        return super().combine(returned, routing, local_state)


def shard_stacked_experts(experts: nn.Module, ep_mesh, total: int) -> None:
    """Split every parameter of ``experts`` (and its children), each stacked over ``total`` experts along dim 0,
    into ``Shard(0)`` DTensors over ``ep_mesh`` holding this rank's experts, then let the module compute with their
    local tensors."""
    from torch.distributed.tensor import DTensor, Shard

    ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for owner in list(experts.modules()):
        for leaf, param in list(owner._parameters.items()):
            if param is None:
                continue
            if param.shape[0] != total:
                raise ValueError(
                    f"ep={ranks}: parameter {leaf!r} of {type(owner).__name__} has leading size {param.shape[0]}, "
                    f"not num_experts={total}; only per-expert stacked tensors can be split over ep"
                )
            local = param.detach().chunk(ranks)[rank]
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                         stride=param.stride())
            owner._parameters[leaf] = nn.Parameter(sharded, requires_grad=param.requires_grad)
    use_local_parameters(experts)


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh,
    dispatcher: Callable[[object, int], TokenDispatcher] = AllToAllDispatcher,
) -> None:
    """Shard the experts of every MoE layer of ``model`` (meta device) over ``ep_mesh`` and swap in
    ``dispatcher(process_group, num_local_experts)``."""
    ranks = ep_mesh.size()
    repeated = {id(layer) for mtp in model.modules() if isinstance(mtp, MultiTokenPrediction)
                and len(mtp.depth_modules()) > len(mtp.depths) for layer in mtp.modules()}
    for moe in model.modules():
        if not isinstance(moe, MoE):
            continue
        experts = moe.experts
        total = experts.num_experts
        shard_stacked_experts(experts, ep_mesh, total)
        moe.dispatcher = dispatcher(ep_mesh.get_group(), total // ranks)
        if id(moe) in repeated and isinstance(moe.dispatcher, AllToAllDispatcher):
            moe.dispatcher.keep_splits = False
