"""LoRA adapters' initial values, as peft draws them: A uniform in +-1/sqrt(fan_in) (kaiming-uniform with
a=sqrt(5)), B zero, so an adapted model starts equal to its base. By parameter name (``.lora_A`` / ``.lora_B``), for
the native decoder and transformers models alike."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_moe.models.seeded_init import module_seed
from lightning_moe.models.weights import copy_tensors_into


def lora_a_bound(fan_in: int) -> float:
    """peft's init of A (kaiming-uniform with a=sqrt(5)) is uniform in +-1/sqrt(fan_in)."""
    return 1.0 / math.sqrt(fan_in)


@torch.no_grad()
def reset_lora_parameters(model: nn.Module) -> int:
    """Initialize every adapter (after ``to_empty``) as peft does: A uniform in +-1/sqrt(fan_in), B zero.

    Values are drawn whole on the CPU, each adapter from a generator seeded by a draw of the torch RNG and its name,
    and each rank keeps its shard, so the adapters are the same whatever the parallel layout (pipeline stages,
    which hold some of the adapters, included). Returns the number of adapter tensors."""
    seed = int(torch.randint(0, 2**62, ()))
    values = []
    for name, param in model.named_parameters():
        if ".lora_A" in name:
            bound = lora_a_bound(param.shape[-1])
            generator = torch.Generator().manual_seed(module_seed(seed, name))
            values.append((name, torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                                         generator=generator)))
        elif ".lora_B" in name:
            values.append((name, torch.zeros(param.shape)))
    return copy_tensors_into(model, values)
