"""transformers' standardized experts module (``integrations/moe.py``, ``use_experts_implementation``): finding it,
and balanced routing for benchmarks.

The module holds stacked ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` parameters over ``num_experts``,
its layout flags (``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``), and is called as
``experts(hidden_states, top_k_index, top_k_weights)`` by the model's MoE block after its router.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.models.layers.moe import bias_update, summed_expert_loads

LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_standardized_experts(module: nn.Module) -> bool:
    """Built by transformers' ``use_experts_implementation`` (its layout flags and stacked projections)."""
    if not all(hasattr(module, flag) for flag in LAYOUT_FLAGS) or not hasattr(module, "num_experts"):
        return False
    up = "gate_up_proj" if module.has_gate else "up_proj"
    return isinstance(getattr(module, up, None), torch.Tensor) and isinstance(getattr(module, "down_proj", None),
                                                                               torch.Tensor)


def standardized_experts(hf_model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in hf_model.named_modules() if is_standardized_experts(m)]


def _balanced_assignment(module: nn.Module, args: tuple) -> tuple:
    hidden_states, top_k_index, top_k_weights = args
    tokens, top_k = top_k_index.shape
    slots = torch.arange(tokens * top_k, device=top_k_index.device)
    return hidden_states, (slots % module.num_experts).view(tokens, top_k).to(top_k_index.dtype), top_k_weights


def force_balanced_routing(hf_model: nn.Module) -> None:
    """Benchmarks: every experts module gets its token copies round-robin over the experts (slot ``i`` of the
    flattened ``[tokens, top_k]`` choice -> expert ``i % num_experts``), as the native ``moe.force_balanced``.
    The router still runs and its top-k weights still scale the outputs (only which expert runs a copy
    changes), so the step costs what a perfectly balanced one does."""
    found = standardized_experts(hf_model)
    if not found:
        raise ValueError(f"force_balanced=True: {type(hf_model).__name__} has no transformers standardized experts "
                         f"module (use_experts_implementation) to route; use force_balanced=False")
    for _, experts in found:
        experts.register_forward_pre_hook(_balanced_assignment)


# ---------------------------------------------------------------------------------------------- aux-loss-free bias
CORRECTION_BIAS = "e_score_correction_bias"


class ExpertLoad:
    """A forward pre-hook counting the token copies an experts module receives (its ``top_k_index``, after any
    balanced-routing hook), summed until :func:`update_correction_biases` takes them; training forwards only."""

    def __init__(self, router: nn.Module, num_experts: int, rate: float) -> None:
        self.router, self.num_experts, self.rate = router, num_experts, rate
        self.counts: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not module.training:
            return
        index = args[1].detach().flatten()
        routed = torch.bincount(index[index < self.num_experts], minlength=self.num_experts)
        self.counts = routed if self.counts is None else self.counts + routed

    def take(self, device: torch.device) -> torch.Tensor:
        counts = self.counts if self.counts is not None else torch.zeros(self.num_experts, dtype=torch.long,
                                                                          device=device)
        self.counts = None
        return counts.to(device)


def correction_bias_routers(hf_model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(block name, router, experts) of every MoE block whose router selects experts by scores plus an
    ``e_score_correction_bias`` (DeepSeek-V3 style aux-loss-free balancing): the block's child holding the bias
    and its standardized experts module (hash-routed layers, e.g. DeepSeek-V4's first ones, have no bias)."""
    found = []
    for name, block in hf_model.named_modules():
        children = list(block.children())
        routers = [c for c in children if isinstance(getattr(c, CORRECTION_BIAS, None), torch.Tensor)]
        experts = [c for c in children if is_standardized_experts(c)]
        if len(routers) == 1 and len(experts) == 1:
            found.append((name, routers[0], experts[0]))
    return found


def track_expert_load(hf_model: nn.Module, rate: float) -> None:
    """Count each correction-bias block's routed token copies, for :func:`update_correction_biases` with
    ``rate``; a one-line error when the model has no such router."""
    found = correction_bias_routers(hf_model)
    if not found:
        raise ValueError(f"model.bias_update_rate={rate}: {type(hf_model).__name__} has no router with an "
                         f"{CORRECTION_BIAS} next to transformers' standardized experts module (aux-loss-free "
                         f"balancing moves that bias); use bias_update_rate: 0")
    for _, router, experts in found:
        load = ExpertLoad(router, experts.num_experts, rate)
        experts.register_forward_pre_hook(load)
        experts._expert_load = load


def expert_load_rate(hf_model: nn.Module) -> float:
    """The ``bias_update_rate`` :func:`track_expert_load` counts loads for (0 when it counts none)."""
    return next((m._expert_load.rate for m in hf_model.modules() if hasattr(m, "_expert_load")), 0.0)


def _add_to_local(bias: torch.Tensor, delta: torch.Tensor) -> None:
    """``bias += delta`` where ``bias`` may be an FSDP-sharded DTensor (Laguna keeps its bias as a frozen
    parameter): each rank adds its own slice of the full ``delta``."""
    if not isinstance(bias, DTensor):
        bias += delta.to(bias.dtype)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = bias.to_local()
    shape, offset = compute_local_shape_and_global_offset(bias.shape, bias.device_mesh, bias.placements)
    piece = delta[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    local[tuple(slice(0, s) for s in shape)] += piece.to(local.dtype)


@torch.no_grad()
def update_correction_biases(model: nn.Module, process_group=None, apply: bool = True) -> None:
    """After an optimizer step: the native ``bias_update`` of every tracked router, from the token copies counted
    since the last update summed over ``process_group`` (default: all ranks), so every rank applies the same
    update. ``apply=False`` (a skipped step) drops the counts."""
    loads = [m._expert_load for m in model.modules() if isinstance(getattr(m, "_expert_load", None), ExpertLoad)]
    if not loads:
        return
    bias = getattr(loads[0].router, CORRECTION_BIAS)
    device = bias.to_local().device if isinstance(bias, DTensor) else bias.device
    counts = torch.stack([load.take(device) for load in loads])
    if not apply:
        return
    for load, count in zip(loads, summed_expert_loads(counts, process_group)):
        if count.sum() > 0:
            _add_to_local(getattr(load.router, CORRECTION_BIAS), bias_update(count, load.rate))
