"""transformers' standardized experts module (``integrations/moe.py``, ``use_experts_implementation``): finding it,
and balanced routing for benchmarks.

The module holds stacked ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` parameters over ``num_experts``,
its layout flags (``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``), and is called as
``experts(hidden_states, top_k_index, top_k_weights)`` by the model's MoE block after its router.
"""

from __future__ import annotations

import torch
from torch import nn

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
