"""GPT-OSS (``GptOssForCausalLM``): GQA with attention sinks and biases, sliding-window and full attention
layers alternating, yarn rope, and an MoE of biased experts with the clamped SwiGLU.

transformers stores each layer's experts fused: ``gate_up_proj`` ``[E, hidden, 2 * inter]`` with gate and up
interleaved column by column (gate even, up odd), ``down_proj`` ``[E, inter, hidden]`` (inputs first) and
biases ``gate_up_proj_bias`` / ``down_proj_bias``. The maps here de-interleave and transpose them into our
stacked ``[E, out, in]`` experts, exactly both ways. Hub checkpoints store the two expert weights as MXFP4
(``*_blocks``, ``*_scales``; see :mod:`lightning_moe.io.quantized`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_moe.models.config import ModelConfig, MoEConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    attention_maps,
    aux_loss_coeff_from_hf,
    aux_loss_coeff_to_hf,
    base_hf_config,
    check_llama_style_pattern,
    embedding_maps,
    llama_style_attention,
    llama_style_model,
    sliding_window_from_hf,
)
from lightning_moe.models.families.qwen2 import sliding_window_to_hf

ARCH = "GptOssForCausalLM"
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}
MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _deinterleave(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., 2n]`` with gate/up alternating along the last dim -> (gate, up), each ``[..., n]``."""
    fused = tensors[0]
    return fused[..., 0::2].contiguous(), fused[..., 1::2].contiguous()


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
    return [torch.stack([gate, up], dim=-1).flatten(-2)]


def _transposed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0].transpose(-1, -2).contiguous()


def _transposed_back(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.transpose(-1, -2).contiguous()]


def expert_maps(block: int, hf_layer: str) -> list[TensorMap]:
    ours, theirs = f"layers.{block}.moe.experts", f"{hf_layer}.mlp.experts"
    return [
        # weights: hub [E, in, out] -> ours [E, out, in]
        TensorMap(f"{ours}.gate_proj", (f"{theirs}.gate_up_proj",),
                  lambda t: tuple(w.transpose(-1, -2).contiguous() for w in _deinterleave(t)),
                  lambda gate, up: _interleave(gate.transpose(-1, -2), up.transpose(-1, -2)),
                  joint=(f"{ours}.up_proj",)),
        TensorMap(f"{ours}.gate_bias", (f"{theirs}.gate_up_proj_bias",), _deinterleave, _interleave,
                  joint=(f"{ours}.up_bias",)),
        TensorMap(f"{ours}.down_proj", (f"{theirs}.down_proj",), _transposed, _transposed_back),
        TensorMap.rename(f"{ours}.down_bias", f"{theirs}.down_proj_bias"),
    ]


def layer_types(hf: dict[str, Any]) -> list[str]:
    """transformers' default when a config has none: sliding-window layers first, then alternating."""
    layers = require(hf, "num_hidden_layers", ARCH)
    return hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


class GptOss(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        bias = bool(hf.get("attention_bias", True))
        attention = llama_style_attention(hf, ARCH, qkv_bias=bias, out_bias=bias, sinks=True)
        sliding_window_from_hf(hf, attention, layer_types(hf))
        cfg = llama_style_model(
            hf, self.name, ARCH, "*E" * require(hf, "num_hidden_layers", ARCH), attention, mlp=None,
            moe=MoEConfig(
                num_experts=require(hf, "num_local_experts", ARCH, "num_experts"),
                top_k=require(hf, "num_experts_per_tok", ARCH),
                intermediate_size=require(hf, "intermediate_size", ARCH),
                activation="swiglu_clamped",
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                expert_bias=True,
                router_bias=True,
                # softmax over the top-k logits = softmax over all, renormalized over the top k
                norm_topk_prob=True,
            ),
            norm_weight_fp32=True,
        )
        cfg.moe.aux_loss_coeff = aux_loss_coeff_from_hf(hf, cfg)
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        moe, att = cfg.moe, cfg.attention
        hf = base_hf_config(cfg, ARCH, self.model_type)
        hf.update(aux_loss_coeff_to_hf(cfg))
        hf.update(
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            intermediate_size=moe.intermediate_size,
            swiglu_alpha=moe.swiglu_alpha,
            swiglu_limit=moe.swiglu_limit,
            attention_bias=att.qkv_bias,
        )
        windows = sliding_window_to_hf(cfg)
        windows.pop("use_sliding_window")
        hf.update(windows)
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_llama_style_pattern(cfg, self.name)
        if "-" in cfg.pattern:
            raise ValueError(f"{self.name}: pattern {cfg.pattern!r} must have an MoE after every attention block")
        maps = embedding_maps(cfg)
        for i in range(len(cfg.pattern) // 2):
            hf_layer, block = f"model.layers.{i}", 2 * i + 1
            maps += attention_maps(cfg, 2 * i, hf_layer)
            maps.append(TensorMap.rename(f"layers.{block}.norm.weight", f"{hf_layer}.post_attention_layernorm.weight"))
            maps.append(TensorMap.rename(f"layers.{block}.moe.router.weight", f"{hf_layer}.mlp.router.weight"))
            maps.append(TensorMap.rename(f"layers.{block}.moe.router.bias", f"{hf_layer}.mlp.router.bias"))
            maps += expert_maps(block, hf_layer)
        return maps

    def hf_quantization_config(self, method: str) -> dict[str, Any] | None:
        return {**MXFP4_CONFIG} if method == "mxfp4" else None

    def quantizes(self, hf_name: str, method: str) -> bool:
        return method == "mxfp4" and hf_name.endswith(MXFP4_TENSORS)


FAMILY = GptOss(name="gpt_oss", architectures=(ARCH,), model_type="gpt_oss")
