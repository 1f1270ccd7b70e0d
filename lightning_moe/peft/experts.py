"""LoRA on stacked experts: one rank-``r`` adapter per expert and projection, run as grouped GEMMs.

The layout follows transformers' fused experts and peft's ``target_parameters`` adapters on them: gate and up
share one adapter (``gate_up``: A ``[E, r, dim]``, B ``[E, 2 * intermediate, r]``, gate rows first), down has its
own (``down``: A ``[E, r, intermediate]``, B ``[E, dim, r]``). Ungated experts (squared ReLU) have ``up`` and
``down``. The low-rank term is added to each projection's grouped GEMM (``GroupedExperts.adapter``), so the
adapted ``[E, out, in]`` weights are never materialized and the frozen weights get no gradient GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.layers.moe import GroupedExperts, grouped_mm
from lightning_moe.models.lora_init import lora_a_bound


def fused_input_projection(experts: GroupedExperts) -> str:
    """Name of the adapter on the experts' input side: ``gate_up`` (gated) or ``up``."""
    return "gate_up" if experts.gate_proj is not None else "up"


class ExpertLora(nn.Module):
    def __init__(self, experts: GroupedExperts, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        num, dim, inter = experts.down_proj.shape
        self.intermediate = inter
        self.scaling = alpha / r
        first = fused_input_projection(experts)
        first_out = 2 * inter if first == "gate_up" else inter
        like = {"device": experts.down_proj.device, "dtype": experts.down_proj.dtype}
        self.lora_A = nn.ParameterDict({
            first: nn.Parameter(torch.empty(num, r, dim, **like)),
            "down": nn.Parameter(torch.empty(num, r, inter, **like)),
        })
        self.lora_B = nn.ParameterDict({
            first: nn.Parameter(torch.empty(num, first_out, r, **like)),
            "down": nn.Parameter(torch.empty(num, dim, r, **like)),
        })
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def reset_parameters(self, init_std: float | None = None) -> None:
        """peft's default init (``init_std`` of the base does not apply): A uniform in +-1/sqrt(fan_in), B zero,
        so the adapted model starts equal to the base."""
        for a in self.lora_A.values():
            bound = lora_a_bound(a.shape[-1])
            nn.init.uniform_(a, -bound, bound)
        for b in self.lora_B.values():
            nn.init.zeros_(b)

    def factors(self, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, in], B [E, out, r]) of one of ``GroupedExperts``' projections."""
        if projection == "down_proj":
            return self.lora_A["down"], self.lora_B["down"]
        key = "gate_up" if "gate_up" in self.lora_A else "up"
        b = self.lora_B[key]
        if key == "gate_up":
            b = b[:, : self.intermediate] if projection == "gate_proj" else b[:, self.intermediate :]
        return self.lora_A[key], b

    def forward(self, projection: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        a, b = self.factors(projection)
        # grouped GEMMs need 16-byte aligned strides: zero-pad the rank (exact: padded ranks contribute 0)
        pad = -a.shape[1] % (16 // a.element_size())
        if pad:
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        low_rank = grouped_mm(self.dropout(x).to(a.dtype), a.transpose(-2, -1), offsets)
        delta = grouped_mm(low_rank, b.transpose(-2, -1), offsets)
        return (delta * self.scaling).to(x.dtype)
