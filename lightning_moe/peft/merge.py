"""Fold adapters into the base weights: ``W + scaling * B @ A`` (computed in fp32, stored in W's dtype)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.models.layers.moe import GroupedExperts
from lightning_moe.peft.lora import ADAPTER_NAME, is_adapter_parameter, lora_modules

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor parameter."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _linear_delta(layer: nn.Module) -> torch.Tensor:
    a = full_tensor(layer.lora_A[ADAPTER_NAME].weight).float()
    b = full_tensor(layer.lora_B[ADAPTER_NAME].weight).float()
    return (b @ a) * layer.scaling[ADAPTER_NAME]


def _expert_delta(experts: GroupedExperts, projection: str) -> torch.Tensor:
    a, b = experts.adapter.factors(projection)
    return torch.bmm(full_tensor(b).float(), full_tensor(a).float()) * experts.adapter.scaling


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Native names (no ``base_layer``) -> base weights with every adapter folded in; adapters left out.
    The model is not modified."""
    state = {}
    for name, tensor in model.state_dict().items():
        if not is_adapter_parameter(name):
            state[name.replace(".base_layer.", ".")] = full_tensor(tensor)
    for name, owner in lora_modules(model).items():
        if isinstance(owner, GroupedExperts):
            for proj in EXPERT_PROJECTIONS:
                if getattr(owner, proj) is not None:
                    key = f"{name}.{proj}"
                    state[key] = (state[key].float() + _expert_delta(owner, proj)).to(state[key].dtype)
        else:
            key = f"{name}.weight"
            state[key] = (state[key].float() + _linear_delta(owner)).to(state[key].dtype)
    return state
