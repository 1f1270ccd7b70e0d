"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama layout with q/k/v biases (no output bias)."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import MLPConfig, ModelConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    base_hf_config,
    check_llama_style_pattern,
    embedding_maps,
    llama_style_attention,
    llama_style_layer_maps,
    llama_style_model,
    qwen_sliding_window_from_hf,
)

ARCH = "Qwen2ForCausalLM"


class Qwen2(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        attention = llama_style_attention(hf, ARCH, qkv_bias=True, out_bias=False)
        qwen_sliding_window_from_hf(hf, attention, ARCH)
        return llama_style_model(
            hf, self.name, ARCH, "*-" * require(hf, "num_hidden_layers", ARCH), attention,
            mlp=MLPConfig(require(hf, "intermediate_size", ARCH)),
        )

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf["intermediate_size"] = cfg.mlp.intermediate_size
        hf.update(sliding_window_to_hf(cfg))
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        return embedding_maps(cfg) + llama_style_layer_maps(cfg)


def sliding_window_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    att = cfg.attention
    if att.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    layers = att.sliding_window_layers or [True] * cfg.pattern.count("*")
    return {
        "use_sliding_window": True,
        "sliding_window": att.sliding_window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in layers],
    }


FAMILY = Qwen2(name="qwen2", architectures=(ARCH,), model_type="qwen2")
