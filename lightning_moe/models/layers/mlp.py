"""Dense feed-forward blocks: SwiGLU (gate/up/down) and squared-ReLU (up/down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "swiglu", bias: bool = False):
        super().__init__()
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"MLP activation {activation!r} is not supported (swiglu, relu2)")
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def reset_parameters(self, init_std: float = 0.02) -> None:
        for linear in self.children():
            nn.init.normal_(linear.weight, std=init_std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))
