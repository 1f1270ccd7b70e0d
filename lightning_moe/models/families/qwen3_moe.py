"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, softmax top-k router, optional dense layers."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import MLPConfig, ModelConfig, MoEConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    aux_loss_coeff_from_hf,
    aux_loss_coeff_to_hf,
    base_hf_config,
    check_llama_style_pattern,
    embedding_maps,
    llama_style_layer_maps,
    llama_style_model,
)
from lightning_moe.models.families.qwen2 import sliding_window_to_hf
from lightning_moe.models.families.qwen3 import qwen3_attention

ARCH = "Qwen3MoeForCausalLM"


class Qwen3Moe(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        layers = require(hf, "num_hidden_layers", ARCH)
        num_experts = require(hf, "num_experts", ARCH, "num_local_experts")
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or [])
        pattern = "".join(
            "*E" if i not in dense and num_experts > 0 and (i + 1) % step == 0 else "*-" for i in range(layers)
        )
        cfg = llama_style_model(
            hf, self.name, ARCH, pattern, qwen3_attention(hf, ARCH, per_layer_windows=False),
            mlp=MLPConfig(hf.get("intermediate_size") or require(hf, "moe_intermediate_size", ARCH)),
            moe=MoEConfig(
                num_experts=num_experts,
                top_k=require(hf, "num_experts_per_tok", ARCH),
                intermediate_size=require(hf, "moe_intermediate_size", ARCH),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            ),
        )
        cfg.moe.aux_loss_coeff = aux_loss_coeff_from_hf(hf, cfg)
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = base_hf_config(cfg, ARCH, self.model_type)
        moe = cfg.moe
        ffn = cfg.pattern[1::2]
        hf.update(aux_loss_coeff_to_hf(cfg))
        hf.update(
            intermediate_size=cfg.mlp.intermediate_size if cfg.mlp else moe.intermediate_size,
            attention_bias=cfg.attention.qkv_bias,
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.intermediate_size,
            norm_topk_prob=moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, s in enumerate(ffn) if s == "-"],
        )
        hf.update(sliding_window_to_hf(cfg))
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        return embedding_maps(cfg) + llama_style_layer_maps(cfg)


FAMILY = Qwen3Moe(name="qwen3_moe", architectures=(ARCH,), model_type="qwen3_moe")
