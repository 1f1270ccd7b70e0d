"""Qwen3 dense (``Qwen3ForCausalLM``): per-head RMSNorm on queries and keys (qk-norm)."""

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
from lightning_moe.models.families.qwen2 import sliding_window_to_hf

ARCH = "Qwen3ForCausalLM"


def qwen3_attention(hf: dict[str, Any], architecture: str, per_layer_windows: bool = True):
    """``per_layer_windows=False``: a sliding window applies to every layer (Qwen3-MoE)."""
    bias = bool(hf.get("attention_bias", False))
    attention = llama_style_attention(hf, architecture, qkv_bias=bias, out_bias=bias, qk_norm=True)
    qwen_sliding_window_from_hf(hf, attention, architecture, per_layer_windows)
    return attention


class Qwen3(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        return llama_style_model(
            hf, self.name, ARCH, "*-" * require(hf, "num_hidden_layers", ARCH), qwen3_attention(hf, ARCH),
            mlp=MLPConfig(require(hf, "intermediate_size", ARCH)),
        )

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf.update(intermediate_size=cfg.mlp.intermediate_size, attention_bias=cfg.attention.qkv_bias)
        hf.update(sliding_window_to_hf(cfg))
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        return embedding_maps(cfg) + llama_style_layer_maps(cfg)


FAMILY = Qwen3(name="qwen3", architectures=(ARCH,), model_type="qwen3")
