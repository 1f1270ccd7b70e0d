"""Llama 2/3.x (``LlamaForCausalLM``): GQA, SwiGLU, llama3 rope scaling, optional attention/MLP biases."""

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
)

ARCH = "LlamaForCausalLM"


class Llama(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        bias = bool(hf.get("attention_bias", False))
        layers = require(hf, "num_hidden_layers", ARCH)
        return llama_style_model(
            hf, self.name, ARCH, "*-" * layers,
            llama_style_attention(hf, ARCH, qkv_bias=bias, out_bias=bias),
            mlp=MLPConfig(require(hf, "intermediate_size", ARCH), "swiglu", bool(hf.get("mlp_bias", False))),
        )

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf.update(
            intermediate_size=cfg.mlp.intermediate_size,
            attention_bias=cfg.attention.qkv_bias,
            mlp_bias=cfg.mlp.bias,
        )
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        return embedding_maps(cfg) + llama_style_layer_maps(cfg)


FAMILY = Llama(name="llama", architectures=(ARCH,), model_type="llama")
