"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight use it too).

Multi-head latent attention, ``first_k_dense_replace`` dense layers then MoE layers with shared experts, a
sigmoid router with aux-loss-free expert bias (``e_score_correction_bias``) and group-limited top-k, and
optional MTP layers stored after the backbone as ``model.layers.{num_hidden_layers + d}``. Hub checkpoints
hold FP8 weights in 128x128 blocks (see :mod:`lightning_moe.io.quantized`).

The layer stack and hub layout are ``families/deepseek_style.py``'s (shared with GLM-4.5).
"""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import AttentionConfig, ModelConfig
from lightning_moe.models.families.base import TensorMap, require
from lightning_moe.models.families.common import (
    base_hf_config,
    mla_maps,
    rope_from_hf,
    sigmoid_moe_to_hf,
)
from lightning_moe.models.families.deepseek_style import DeepseekStyle

ARCH = "DeepseekV3ForCausalLM"
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# hub tensors DeepSeek keeps in bf16: embeddings, output heads, the router, norms (1-D anyway) and the MTP
# layers' input projection
FP8_UNQUANTIZED = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.", "norm", "eh_proj")


# ---------------------------------------------------------------------------------------------- config
def mla_from_hf(hf: dict[str, Any], architecture: str) -> AttentionConfig:
    heads = require(hf, "num_attention_heads", architecture)
    bias = bool(hf.get("attention_bias", False))
    rope = rope_from_hf(hf, architecture)
    rope.interleave = bool(hf.get("rope_interleave", True))
    rope_dim = require(hf, "qk_rope_head_dim", architecture)
    return AttentionConfig(
        type="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=rope_dim,  # what transformers reports as head_dim: the rotary width
        qkv_bias=bias,
        out_bias=bias,
        rope=rope,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=require(hf, "kv_lora_rank", architecture),
        qk_nope_head_dim=require(hf, "qk_nope_head_dim", architecture),
        qk_rope_head_dim=rope_dim,
        v_head_dim=require(hf, "v_head_dim", architecture),
    )


class DeepseekV3(DeepseekStyle):
    def attention_from_hf(self, hf: dict[str, Any]) -> AttentionConfig:
        return mla_from_hf(hf, ARCH)

    def attention_maps(self, cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
        if cfg.attention.type != "mla":
            raise ValueError(f"{self.name}: attention.type must be 'mla', got {cfg.attention.type!r}")
        return mla_maps(cfg, block, hf_layer)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        att = cfg.attention
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf.update(sigmoid_moe_to_hf(cfg, self.name))
        hf.update(
            head_dim=att.qk_rope_head_dim,
            q_lora_rank=att.q_lora_rank,
            kv_lora_rank=att.kv_lora_rank,
            qk_nope_head_dim=att.qk_nope_head_dim,
            qk_rope_head_dim=att.qk_rope_head_dim,
            v_head_dim=att.v_head_dim,
            attention_bias=att.qkv_bias,
            rope_interleave=att.rope.interleave,
        )
        return hf

    def hf_quantization_config(self, method: str) -> dict[str, Any] | None:
        return dict(FP8_BLOCK_CONFIG) if method == "fp8-block" else None

    def quantizes(self, hf_name: str, method: str) -> bool:
        return method == "fp8-block" and hf_name.endswith(".weight") and not any(p in hf_name for p in FP8_UNQUANTIZED)


FAMILY = DeepseekV3(name="deepseek_v3", architectures=(ARCH,), model_type="deepseek_v3")
