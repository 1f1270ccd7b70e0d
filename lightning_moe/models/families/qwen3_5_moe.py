"""Qwen3.5 MoE text model (``Qwen3_5MoeForCausalLM``): the dense Qwen3.5 file's translation, an MoE in every
layer (see ``qwen3_5.py``)."""

from __future__ import annotations

from lightning_moe.models.families.qwen3_5 import Qwen3_5

ARCH = "Qwen3_5MoeForCausalLM"


class Qwen3_5Moe(Qwen3_5):
    moe = True


FAMILY = Qwen3_5Moe(name="qwen3_5_moe", architectures=(ARCH,), model_type="qwen3_5_moe_text")
