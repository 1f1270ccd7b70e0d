"""Llama 2/3.x (``LlamaForCausalLM``): GQA, SwiGLU, llama3 rope scaling, optional attention/MLP biases."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    base_hf_config,
    check_llama_style_pattern,
    embedding_maps,
    llama_style_layer_maps,
    rope_from_hf,
)

ARCH = "LlamaForCausalLM"


def check_silu(hf: dict[str, Any], architecture: str, key: str = "hidden_act") -> None:
    act = hf.get(key, "silu")
    if act != "silu":
        raise ValueError(f"config.json ({architecture}): {key}={act!r} is not supported (silu)")


def llama_style_attention(hf: dict[str, Any], architecture: str, **overrides: Any) -> AttentionConfig:
    heads = require(hf, "num_attention_heads", architecture)
    head_dim = hf.get("head_dim") or require(hf, "hidden_size", architecture) // heads
    att = AttentionConfig(
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope=rope_from_hf(hf, architecture),
    )
    for key, value in overrides.items():
        setattr(att, key, value)
    return att


def llama_style_model(hf: dict[str, Any], family: str, architecture: str, pattern: str,
                      attention: AttentionConfig, **kwargs: Any) -> ModelConfig:
    check_silu(hf, architecture)
    return ModelConfig(
        family=family,
        vocab_size=require(hf, "vocab_size", architecture),
        hidden_size=require(hf, "hidden_size", architecture),
        pattern=pattern,
        attention=attention,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        init_std=hf.get("initializer_range", 0.02),
        **kwargs,
    )


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
