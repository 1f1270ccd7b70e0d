"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight use it too).

Multi-head latent attention, ``first_k_dense_replace`` dense layers then MoE layers with shared experts, a
sigmoid router with aux-loss-free expert bias (``e_score_correction_bias``) and group-limited top-k, and
optional MTP layers stored after the backbone as ``model.layers.{num_hidden_layers + d}``. Hub checkpoints
hold FP8 weights in 128x128 blocks (see :mod:`lightning_moe.checkpoint.quantized`).

The MoE, first-k-dense and MTP translations here are shared with GLM-4.5 (same hub layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig, MTPConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    LayerNames,
    base_hf_config,
    mlp_maps,
    moe_maps,
    rope_from_hf,
)
from lightning_moe.models.families.llama import llama_style_model

ARCH = "DeepseekV3ForCausalLM"
# DeepSeek-V3's bias update speed (gamma); GLM-4.5 uses the same
BIAS_UPDATE_RATE = 1e-3
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# hub tensors DeepSeek keeps in bf16: embeddings, output heads, the router, norms (1-D anyway) and the MTP
# layers' input projection
FP8_UNQUANTIZED = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.", "norm", "eh_proj")


# ---------------------------------------------------------------------------------------------- config
def first_k_dense_pattern(hf: dict[str, Any], architecture: str) -> str:
    """``first_k_dense_replace`` (attention, MLP) layers, then (attention, MoE) layers."""
    layers = require(hf, "num_hidden_layers", architecture)
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json ({architecture}): moe_layer_freq={hf['moe_layer_freq']} is not supported (1)")
    dense = min(int(hf.get("first_k_dense_replace") or 0), layers)
    if not hf.get("n_routed_experts"):
        dense = layers
    return "*-" * dense + "*E" * (layers - dense)


def sigmoid_moe_from_hf(hf: dict[str, Any], architecture: str) -> MoEConfig:
    """DeepSeek-style router: sigmoid scores, selection-only bias, group-limited top-k, shared experts."""
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"config.json ({architecture}): scoring_func={scoring!r} is not supported (sigmoid)")
    method = hf.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"config.json ({architecture}): topk_method={method!r} is not supported (noaux_tc)")
    return MoEConfig(
        num_experts=require(hf, "n_routed_experts", architecture),
        top_k=require(hf, "num_experts_per_tok", architecture),
        intermediate_size=require(hf, "moe_intermediate_size", architecture),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        score_func="sigmoid",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        bias_update_rate=BIAS_UPDATE_RATE,
    )


def mtp_from_checkpoint(cfg: ModelConfig, tensor_names: Collection[str]) -> ModelConfig:
    """Keep ``num_nextn_predict_layers`` MTP depths only if the checkpoint holds them: transformers neither
    builds nor saves them, so its checkpoints declare MTP layers they do not have."""
    first = f"model.layers.{cfg.pattern.count('*')}."
    if cfg.mtp is not None and not any(name.startswith(first) for name in tensor_names):
        cfg.mtp = None
    elif cfg.mtp is not None:
        cfg.mtp.hub_weight_copies = f"{first}embed_tokens.weight" in tensor_names
    return cfg


def mtp_config(hf: dict[str, Any], pattern: str) -> MTPConfig | None:
    """Each MTP depth is one more decoder layer, an MoE layer whenever the backbone has any."""
    depths = int(hf.get("num_nextn_predict_layers") or 0)
    return MTPConfig(num_layers=depths, pattern="*E" if "E" in pattern else "*-") if depths else None


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


def first_k_dense(cfg: ModelConfig, family: str) -> int:
    """Number of leading dense layers of a DeepSeek-style pattern (``*-`` pairs, then only ``*E`` pairs)."""
    pairs = [cfg.pattern[i : i + 2] for i in range(0, len(cfg.pattern), 2)]
    dense = next((i for i, p in enumerate(pairs) if p != "*-"), len(pairs))
    if len(cfg.pattern) % 2 or any(p != "*E" for p in pairs[dense:]):
        raise ValueError(f"{family}: pattern {cfg.pattern!r} must be '*-' pairs followed by '*E' pairs")
    return dense


def sigmoid_moe_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The MoE and MTP keys of DeepSeek-style configs."""
    dense = first_k_dense(cfg, family)
    moe = cfg.moe
    hf: dict[str, Any] = {
        "intermediate_size": cfg.mlp.intermediate_size if cfg.mlp else moe.intermediate_size,
        "first_k_dense_replace": dense,
        "num_nextn_predict_layers": cfg.mtp.stored_layers if cfg.mtp else 0,
    }
    if moe is not None:
        hf.update(
            moe_intermediate_size=moe.intermediate_size,
            n_routed_experts=moe.num_experts,
            n_shared_experts=moe.num_shared_experts,
            num_experts_per_tok=moe.top_k,
            routed_scaling_factor=moe.routed_scaling_factor,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            norm_topk_prob=moe.norm_topk_prob,
        )
    return hf


# ---------------------------------------------------------------------------------------------- weights
def mla_maps(cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
    att = cfg.attention
    ours, theirs = f"layers.{block}.attn", f"{hf_layer}.self_attn"
    maps = [TensorMap.rename(f"layers.{block}.norm.weight", f"{hf_layer}.input_layernorm.weight")]

    def linear(native: str, hf: str, bias: bool = False) -> None:
        maps.append(TensorMap.rename(f"{ours}.{native}.weight", f"{theirs}.{hf}.weight"))
        if bias:
            maps.append(TensorMap.rename(f"{ours}.{native}.bias", f"{theirs}.{hf}.bias"))

    if att.q_lora_rank:
        linear("q_a_proj", "q_a_proj", att.qkv_bias)
        maps.append(TensorMap.rename(f"{ours}.q_a_norm.weight", f"{theirs}.q_a_layernorm.weight"))
        linear("q_b_proj", "q_b_proj")
    else:
        linear("q_proj", "q_proj")
    linear("kv_a_proj", "kv_a_proj_with_mqa", att.qkv_bias)
    maps.append(TensorMap.rename(f"{ours}.kv_a_norm.weight", f"{theirs}.kv_a_layernorm.weight"))
    linear("kv_b_proj", "kv_b_proj")
    linear("o_proj", "o_proj", att.out_bias)
    return maps


def sigmoid_moe_maps(cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
    maps = moe_maps(cfg, block, hf_layer, LayerNames())
    maps.append(TensorMap.rename(f"layers.{block}.moe.router.score_correction_bias",
                                 f"{hf_layer}.mlp.gate.e_score_correction_bias"))
    if cfg.moe.num_shared_experts:
        maps += mlp_maps(block, f"{hf_layer}.mlp.shared_experts", native="moe.shared_experts")
    return maps


# (cfg, block, hf_layer) -> the maps of one attention block and its input norm
AttentionMaps = Callable[[ModelConfig, int, str], list[TensorMap]]


def decoder_layer_maps(cfg: ModelConfig, pattern: str, hf_layer: str, attention: AttentionMaps,
                       block: int = 0) -> list[TensorMap]:
    """One hub decoder layer = our (attention, MLP or MoE) block pair starting at ``block``."""
    maps = attention(cfg, block, hf_layer)
    maps.append(TensorMap.rename(f"layers.{block + 1}.norm.weight", f"{hf_layer}.post_attention_layernorm.weight"))
    if pattern[block + 1] == "E":
        maps += sigmoid_moe_maps(cfg, block + 1, hf_layer)
    else:
        maps += mlp_maps(block + 1, f"{hf_layer}.mlp")
    return maps


def identical_copies(native: str, hf: Sequence[str]) -> TensorMap:
    """One native tensor stored several times in the hub (DeepSeek's MTP layers repeat the embedding and the
    output layer): import checks that the copies are equal, export writes them all."""

    def to_native(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        first = tensors[0]
        if not first.is_meta:
            for name, copy in zip(hf[1:], tensors[1:]):
                if not torch.equal(copy, first):
                    raise ValueError(f"hub tensor {name} differs from {hf[0]}: they must be copies of one {native}")
        return first

    def to_hf(tensor: torch.Tensor) -> list[torch.Tensor]:
        # separate storage: safetensors refuses to write tensors that share memory
        return [tensor] + [tensor.clone() for _ in hf[1:]]

    return TensorMap(native, tuple(hf), to_native, to_hf)


def prefixed(prefix: str, maps: list[TensorMap]) -> list[TensorMap]:
    """``maps`` with ``prefix`` before every native name (an MTP depth's)."""
    return [dataclasses.replace(m, native=prefix + m.native, joint=tuple(prefix + n for n in m.joint)) for m in maps]


def backbone_and_mtp_maps(cfg: ModelConfig, attention: AttentionMaps) -> list[TensorMap]:
    """Embeddings, every decoder layer and the MTP layers ``model.layers.{L + d}`` (enorm, hnorm, eh_proj, one
    decoder layer, ``shared_head.norm``, and copies of the embedding and output layer)."""
    layers = len(cfg.pattern) // 2
    depths = cfg.mtp.stored_layers if cfg.mtp else 0
    mtp_layers = [f"model.layers.{layers + d}" for d in range(depths)]
    copies = mtp_layers if depths and cfg.mtp.hub_weight_copies else []
    embed_copies = ["model.embed_tokens.weight"] + [f"{hub}.embed_tokens.weight" for hub in copies]
    head_copies = [f"{hub}.shared_head.head.weight" for hub in copies]
    if cfg.tie_embeddings:
        maps = [identical_copies("embed.weight", embed_copies + head_copies)]
    else:
        maps = [identical_copies("embed.weight", embed_copies),
                identical_copies("lm_head.weight", ["lm_head.weight", *head_copies])]
    maps.append(TensorMap.rename("norm.weight", "model.norm.weight"))
    for i in range(layers):
        maps += decoder_layer_maps(cfg, cfg.pattern, f"model.layers.{i}", attention, block=2 * i)
    for d, hub in enumerate(mtp_layers):
        depth = [TensorMap.rename(f"{norm}.weight", f"{hub}.{norm}.weight") for norm in ("enorm", "hnorm")]
        depth.append(TensorMap.rename("eh_proj.weight", f"{hub}.eh_proj.weight"))
        depth.append(TensorMap.rename("final_norm.weight", f"{hub}.shared_head.norm.weight"))
        depth += decoder_layer_maps(cfg, cfg.mtp.pattern, hub, attention)
        maps += prefixed(f"mtp.depths.{d}.", depth)
    return maps


class DeepseekStyle(Family):
    """A family with DeepSeek-V3's layer stack and hub layout; subclasses choose the attention."""

    def attention_from_hf(self, hf: dict[str, Any]) -> AttentionConfig:
        raise NotImplementedError

    def attention_maps(self, cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
        raise NotImplementedError

    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        architecture = self.architectures[0]
        pattern = first_k_dense_pattern(hf, architecture)
        return llama_style_model(
            hf, self.name, architecture, pattern, self.attention_from_hf(hf),
            mlp=MLPConfig(require(hf, "intermediate_size", architecture)),
            moe=sigmoid_moe_from_hf(hf, architecture) if "E" in pattern else None,
            mtp=mtp_config(hf, pattern),
        )

    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        return mtp_from_checkpoint(self.from_hf_config(hf), tensor_names)

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        first_k_dense(cfg, self.name)
        return backbone_and_mtp_maps(cfg, self.attention_maps)


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
