"""Mixtral (``MixtralForCausalLM``): every FFN an MoE of SwiGLU experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import ModelConfig, MoEConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    LayerNames,
    aux_loss_coeff_from_hf,
    aux_loss_coeff_to_hf,
    base_hf_config,
    check_llama_style_pattern,
    embedding_maps,
    llama_style_attention,
    llama_style_layer_maps,
    llama_style_model,
    sliding_window_from_hf,
)

ARCH = "MixtralForCausalLM"
NAMES = LayerNames(ffn="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2")


class Mixtral(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        attention = llama_style_attention(hf, ARCH)
        sliding_window_from_hf(hf, attention)
        cfg = llama_style_model(
            hf, self.name, ARCH, "*E" * require(hf, "num_hidden_layers", ARCH), attention, mlp=None,
            moe=MoEConfig(
                num_experts=require(hf, "num_local_experts", ARCH),
                top_k=require(hf, "num_experts_per_tok", ARCH),
                intermediate_size=require(hf, "intermediate_size", ARCH),
                norm_topk_prob=True,
            ),
        )
        cfg.moe.aux_loss_coeff = aux_loss_coeff_from_hf(hf, cfg)
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = base_hf_config(cfg, ARCH, self.model_type)
        moe = cfg.moe
        hf.update(aux_loss_coeff_to_hf(cfg))
        hf.update(
            intermediate_size=moe.intermediate_size,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            sliding_window=cfg.attention.sliding_window,
        )
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        return embedding_maps(cfg) + llama_style_layer_maps(cfg, NAMES)


FAMILY = Mixtral(name="mixtral", architectures=(ARCH,), model_type="mixtral")
