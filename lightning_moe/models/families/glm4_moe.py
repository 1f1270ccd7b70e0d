"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``): GQA with partial rotary and optional qk-norm, then the
DeepSeek-V3 MoE recipe (first-k dense layers, sigmoid router with expert bias, shared expert) and hub layout,
MTP layers included."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import AttentionConfig, ModelConfig
from lightning_moe.models.families.base import TensorMap
from lightning_moe.models.families.common import (
    attention_maps,
    base_hf_config,
    llama_style_attention,
    sigmoid_moe_to_hf,
)
from lightning_moe.models.families.deepseek_style import DeepseekStyle

ARCH = "Glm4MoeForCausalLM"
# transformers' value when a config names none
DEFAULT_PARTIAL_ROTARY = 0.5


class Glm4Moe(DeepseekStyle):
    def attention_from_hf(self, hf: dict[str, Any]) -> AttentionConfig:
        attention = llama_style_attention(
            hf, ARCH, qkv_bias=bool(hf.get("attention_bias", False)), out_bias=False,
            qk_norm=bool(hf.get("use_qk_norm", False)),
        )
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if "partial_rotary_factor" not in rope_params and hf.get("partial_rotary_factor") is None:
            attention.rope.partial_rotary_factor = DEFAULT_PARTIAL_ROTARY
        return attention

    def attention_maps(self, cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
        return attention_maps(cfg, block, hf_layer)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        att = cfg.attention
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf.update(sigmoid_moe_to_hf(cfg, self.name))
        # always explicit: transformers reads a missing factor as 0.5
        hf["rope_parameters"]["partial_rotary_factor"] = att.rope.partial_rotary_factor
        hf.update(attention_bias=att.qkv_bias, use_qk_norm=att.qk_norm)
        return hf


FAMILY = Glm4Moe(name="glm4_moe", architectures=(ARCH,), model_type="glm4_moe")
