"""Expert parallelism for transformers MoEs whose experts are transformers' standardized experts module.

transformers 5 gives most MoE architectures one experts module (``integrations/moe.py``,
``use_experts_implementation``): stacked ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` parameters
``[E, out, in]`` (``[E, in, out]`` when ``is_transposed``), optional biases ``[E, out]``, called as
``experts(hidden_states, top_k_index, top_k_weights)``. Here, as for the native MoE (``parallel/expert.py``):

* the stacked parameters become DTensors ``Shard(0)`` over the ``ep`` mesh (checkpoints and FSDP still see
  the global ``[E, ...]`` tensors; FSDP2 shards the local experts over ``expert_fsdp``, ``parallel/fsdp.py``);
* the experts' forward routes the token copies with the package's :class:`AllToAllDispatcher` (every rank
  takes part in both all-to-alls even with no token to send or receive) and runs the local experts through
  grouped GEMM, honouring the module's layout flags (``is_transposed``, ``has_bias``, ``has_gate`` with its own
  ``_apply_gate``, which knows concatenated or interleaved gate/up rows, ``has_post_expert_norm``).

transformers' own ``distributed/expert_parallel.py`` is not used: its styles install DTensor placeholders
driven by each model's ``ep_plan`` and meshes from its ``DistributedConfig`` (EP folded with its TP and FSDP),
and leave the experts to its ``fsdp_plan``; the package's meshes (EP carved out of ``dp_shard x cp x tp``,
experts FSDP-sharded over ``expert_fsdp`` with the dense mean convention) and its dispatcher interface
(DeepEP plugs in the same way) are kept instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_moe.models.hf_experts import is_standardized_experts, standardized_experts
from lightning_moe.models.layers.moe import Routing, TokenDispatcher, grouped_mm
from lightning_moe.parallel.expert import AllToAllDispatcher, shard_stacked_experts


def other_expert_modules(hf_model: nn.Module) -> list[str]:
    """Class names of modules named ``experts`` that are not the standardized module (a ``ModuleList`` of
    per-expert MLPs, a remote-code layout): expert parallelism cannot split those."""
    return sorted({type(m).__name__ for name, m in hf_model.named_modules()
                   if name.rpartition(".")[2] == "experts" and not is_standardized_experts(m)})


def check_hf_expert_parallel(hf_model: nn.Module, ep: int) -> None:
    """A one-line error unless every experts module of ``hf_model`` is standardized and ``ep`` divides it."""
    model = type(hf_model).__name__
    others = other_expert_modules(hf_model)
    if others:
        raise ValueError(f"ep={ep}: {model}'s experts ({', '.join(others)}) are not transformers' standardized "
                         f"experts module (use_experts_implementation: stacked gate_up_proj/down_proj), which the "
                         f"generic path splits over ep; use ep=1, or a natively supported architecture")
    found = standardized_experts(hf_model)
    # a pipeline stage's view of the model (parallel/pipeline_hf.py) may hold dense layers only
    if not found and not getattr(hf_model, "is_pipeline_stage", False):
        raise ValueError(f"ep={ep}: {model} has no experts module to split; use ep=1")
    for name, experts in found:
        if experts.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={experts.num_experts} of {name}; use an ep "
                             f"that divides it")


def _project(experts: nn.Module, name: str, rows: torch.Tensor, counts: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    """Rows sorted by local expert through the stacked projection ``name`` (and its bias)."""
    weight = getattr(experts, name)
    out = grouped_mm(rows, weight if experts.is_transposed else weight.transpose(-2, -1), offsets)
    if experts.has_bias:
        bias = getattr(experts, f"{name}_bias")
        out = out + torch.repeat_interleave(bias, counts, dim=0, output_size=rows.shape[0])
    return out


def local_experts_forward(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows`` [N, hidden] sorted by local expert, ``counts`` [local experts] -> [N, hidden], unweighted."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if experts.has_gate:
        hidden = experts._apply_gate(_project(experts, "gate_up_proj", rows, counts, offsets))
    else:
        hidden = experts.act_fn(_project(experts, "up_proj", rows, counts, offsets))
    out = _project(experts, "down_proj", hidden, counts, offsets)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return out


def _expert_parallel_forward(experts: nn.Module, dispatcher: TokenDispatcher, num_experts: int):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = Routing(experts=top_k_index, weights=top_k_weights, scores=None)
        rows, counts, state = dispatcher.dispatch(hidden_states, routing, num_experts)
        out = local_experts_forward(experts, rows, counts)
        return dispatcher.combine(out, routing, state).to(hidden_states.dtype)

    return forward


def apply_hf_expert_parallel(hf_model: nn.Module, ep_mesh,
                             dispatcher: Callable[[object, int], TokenDispatcher] = AllToAllDispatcher) -> None:
    """Split every standardized experts module of ``hf_model`` (meta device) over ``ep_mesh`` and route its
    tokens with ``dispatcher(process_group, num_local_experts)``."""
    check_hf_expert_parallel(hf_model, ep_mesh.size())
    ranks = ep_mesh.size()
    for _, experts in standardized_experts(hf_model):
        total = experts.num_experts
        shard_stacked_experts(experts, ep_mesh, total)
        # an instance attribute: the class forward (transformers' implementation switch) stays for other models
        experts.forward = _expert_parallel_forward(experts, dispatcher(ep_mesh.get_group(), total // ranks), total)
