"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet and gated attention layers, MoE with a gated shared expert.

One hub layer ``model.layers.{i}`` is our block pair ``(2i, 2i + 1)``: the token mixer (``G`` Gated DeltaNet for
``linear_attention``, ``*`` for ``full_attention``: GQA with qk-norm, partial rope and a sigmoid output gate
from a second half of ``q_proj``) with ``input_layernorm``, then an MoE (``E``: softmax top-k router, one shared
expert scaled by ``sigmoid(shared_expert_gate)``) or a dense MLP (``-``, ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid) with ``post_attention_layernorm``. Every RMSNorm scales by ``1 + weight``.

The hub's ``in_proj_qkvz`` holds, per key head, its ``q | k | v | z`` rows (``in_proj_ba``: ``b | a``); the
native mixer has Qwen3.5's split projections, so import/export permutes rows (exact both ways).

The hub's MTP layer (``mtp.*``, which transformers' model ignores) is one native MTP depth: ``pre_fc_norm_embedding``
/ ``pre_fc_norm_hidden`` / ``fc`` / ``norm`` are its ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_norm`` (the same
``fc([norm(embedding) | norm(hidden)])``), and ``mtp.layers.0`` a gated-attention + MoE (or MLP) layer of the
backbone's kind. Checkpoints without ``mtp.*`` tensors (transformers') build no MTP depth.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_moe.models.config import LinearAttentionConfig, MLPConfig, ModelConfig, MoEConfig, MTPConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    LayerNames,
    attention_maps,
    aux_loss_coeff_from_hf,
    aux_loss_coeff_to_hf,
    base_hf_config,
    embedding_maps,
    llama_style_attention,
    llama_style_model,
    mlp_maps,
    moe_maps,
    prefixed,
)

ARCH = "Qwen3NextForCausalLM"
MIXERS = {"linear_attention": "G", "full_attention": "*"}
LAYER_TYPES = {v: k for k, v in MIXERS.items()}
CHUNK_SIZE = 64  # fla's and transformers' chunk for the gated delta rule


def layer_types_from_hf(hf: dict[str, Any], architecture: str) -> list[str]:
    layers = require(hf, "num_hidden_layers", architecture)
    interval = hf.get("full_attention_interval") or 4
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    unknown = sorted(set(types) - set(MIXERS))
    if unknown or len(types) != layers:
        raise ValueError(f"config.json ({architecture}): layer_types must list {layers} of {sorted(MIXERS)}, "
                         f"got {len(types)} with unknown {unknown}")
    return types


def moe_layers(hf: dict[str, Any], layers: int) -> list[bool]:
    """transformers' rule: MoE unless in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    experts = hf.get("num_experts") or 0
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)]


def linear_attention_from_hf(hf: dict[str, Any], architecture: str) -> LinearAttentionConfig:
    return LinearAttentionConfig(
        num_k_heads=require(hf, "linear_num_key_heads", architecture),
        num_v_heads=require(hf, "linear_num_value_heads", architecture),
        head_k_dim=require(hf, "linear_key_head_dim", architecture),
        head_v_dim=require(hf, "linear_value_head_dim", architecture),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        chunk_size=CHUNK_SIZE,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )


def qwen3_next_model(hf: dict[str, Any], family: str, architecture: str) -> ModelConfig:
    """The config shared by Qwen3-Next and the Qwen3.5 text models."""
    types = layer_types_from_hf(hf, architecture)
    sparse = moe_layers(hf, len(types))
    pattern = "".join(MIXERS[t] + ("E" if s else "-") for t, s in zip(types, sparse))
    bias = bool(hf.get("attention_bias", False))
    attention = llama_style_attention(hf, architecture, qkv_bias=bias, out_bias=bias, qk_norm=True, output_gate=True)
    moe = None
    if "E" in pattern:
        shared = int(require(hf, "shared_expert_intermediate_size", architecture))
        moe = MoEConfig(
            num_experts=require(hf, "num_experts", architecture),
            top_k=require(hf, "num_experts_per_tok", architecture),
            intermediate_size=require(hf, "moe_intermediate_size", architecture),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_shared_experts=1 if shared else 0,
            shared_intermediate_size=shared or None,
            shared_expert_gate=bool(shared),
        )
    cfg = llama_style_model(
        hf, family, architecture, pattern, attention,
        mlp=MLPConfig(require(hf, "intermediate_size", architecture)) if "-" in pattern else None,
        moe=moe,
        linear_attention=linear_attention_from_hf(hf, architecture) if "G" in pattern else None,
        norm_offset=True,
    )
    if moe is not None:
        cfg.moe.aux_loss_coeff = aux_loss_coeff_from_hf(hf, cfg)
    return cfg


def check_pattern(cfg: ModelConfig, family: str) -> None:
    pairs = [cfg.pattern[i : i + 2] for i in range(0, len(cfg.pattern), 2)]
    if len(cfg.pattern) % 2 or any(p[0] not in "*G" or p[1] not in "-E" for p in pairs):
        raise ValueError(f"{family}: pattern {cfg.pattern!r} must be (attention or Gated DeltaNet, MLP or MoE) "
                         "pairs like 'GEGE*E'")
    att = cfg.attention
    if "*" in cfg.pattern and not (att.qk_norm and att.output_gate and att.type == "gqa"):
        raise ValueError(f"{family}: attention must be GQA with qk_norm and output_gate (gated attention)")
    if not cfg.norm_offset:
        raise ValueError(f"{family}: norm_offset must be True (every RMSNorm scales by 1 + weight)")
    if cfg.moe is not None and cfg.moe.num_shared_experts not in (0, 1):
        raise ValueError(f"{family}: at most one shared expert, got moe.num_shared_experts={cfg.moe.num_shared_experts}")


def qwen3_next_hf_config(cfg: ModelConfig, family: str, architecture: str, model_type: str) -> dict[str, Any]:
    check_pattern(cfg, family)
    hf = base_hf_config(cfg, architecture, model_type)
    mixers, ffn = cfg.pattern[0::2], cfg.pattern[1::2]
    hf.update(
        num_hidden_layers=len(mixers),
        layer_types=[LAYER_TYPES[s] for s in mixers],
        attention_bias=cfg.attention.qkv_bias,
        intermediate_size=cfg.mlp.intermediate_size if cfg.mlp else (cfg.moe.intermediate_size if cfg.moe else 0),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, s in enumerate(ffn) if s == "-"],
        num_experts=cfg.moe.num_experts if cfg.moe else 0,
    )
    hf["rope_parameters"].setdefault("partial_rotary_factor", cfg.attention.rope.partial_rotary_factor)
    la = cfg.linear_attention
    if la is not None:
        hf.update(linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
                  linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
                  linear_conv_kernel_dim=la.conv_kernel)
    moe = cfg.moe
    if moe is not None:
        hf.update(aux_loss_coeff_to_hf(cfg))
        hf.update(num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.intermediate_size,
                  norm_topk_prob=moe.norm_topk_prob,
                  shared_expert_intermediate_size=moe.shared_size if moe.num_shared_experts else 0)
    return hf


# ---------------------------------------------------------------------------------------------- weights
def _per_key_head(cfg: ModelConfig) -> tuple[int, int, int, int]:
    la = cfg.linear_attention
    return la.num_k_heads, la.head_k_dim, la.num_v_heads // la.num_k_heads * la.head_v_dim, la.num_v_heads // la.num_k_heads


def fused_qkvz_map(cfg: ModelConfig, native: str, hub: str) -> list[TensorMap]:
    """``in_proj_qkvz`` (per key head ``q | k | v | z``) <-> ``in_proj_qkv`` (all q | all k | all v) and
    ``in_proj_z``; ``in_proj_ba`` (per key head ``b | a``) <-> ``in_proj_b`` and ``in_proj_a``."""
    heads, dk, dv_group, per = _per_key_head(cfg)

    def qkvz_to_native(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w = tensors[0]
        q, k, v, z = w.view(heads, -1, w.shape[-1]).split([dk, dk, dv_group, dv_group], dim=1)
        return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)]), z.reshape(-1, w.shape[-1])

    def qkvz_to_hf(qkv: torch.Tensor, z: torch.Tensor) -> list[torch.Tensor]:
        hidden = qkv.shape[-1]
        q, k, v = qkv.split([heads * dk, heads * dk, heads * dv_group])
        parts = [t.reshape(heads, -1, hidden) for t in (q, k, v, z)]
        return [torch.cat(parts, dim=1).reshape(-1, hidden)]

    def ba_to_native(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w = tensors[0]
        b, a = w.view(heads, 2 * per, w.shape[-1]).split([per, per], dim=1)
        return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])

    def ba_to_hf(b: torch.Tensor, a: torch.Tensor) -> list[torch.Tensor]:
        hidden = b.shape[-1]
        return [torch.cat([b.view(heads, per, hidden), a.view(heads, per, hidden)], dim=1).reshape(-1, hidden)]

    return [
        TensorMap(f"{native}.in_proj_qkv.weight", (f"{hub}.in_proj_qkvz.weight",), qkvz_to_native, qkvz_to_hf,
                  joint=(f"{native}.in_proj_z.weight",)),
        TensorMap(f"{native}.in_proj_b.weight", (f"{hub}.in_proj_ba.weight",), ba_to_native, ba_to_hf,
                  joint=(f"{native}.in_proj_a.weight",)),
    ]


def split_projection_maps(native: str, hub: str) -> list[TensorMap]:
    """Qwen3.5's projections, named as ours."""
    return [TensorMap.rename(f"{native}.{p}.weight", f"{hub}.{p}.weight")
            for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]


def gdn_maps(cfg: ModelConfig, block: int, hf_layer: str, fused: bool) -> list[TensorMap]:
    native, hub = f"layers.{block}.gdn", f"{hf_layer}.linear_attn"
    maps = [TensorMap.rename(f"layers.{block}.norm.weight", f"{hf_layer}.input_layernorm.weight")]
    maps += fused_qkvz_map(cfg, native, hub) if fused else split_projection_maps(native, hub)
    maps += [TensorMap.rename(f"{native}.{n}", f"{hub}.{n}")
             for n in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
    return maps


def qwen3_next_layer_maps(cfg: ModelConfig, fused: bool, prefix: str = "model",
                          pattern: str | None = None) -> list[TensorMap]:
    """Layers ``{prefix}.layers.{i}`` of ``pattern`` (default: the backbone's) <-> native blocks ``(2i, 2i + 1)``."""
    pattern = pattern or cfg.pattern
    maps = []
    for i in range(len(pattern) // 2):
        hf_layer, mixer, ffn = f"{prefix}.layers.{i}", 2 * i, 2 * i + 1
        if pattern[mixer] == "G":
            maps += gdn_maps(cfg, mixer, hf_layer, fused)
        else:
            maps += attention_maps(cfg, mixer, hf_layer)
        maps.append(TensorMap.rename(f"layers.{ffn}.norm.weight", f"{hf_layer}.post_attention_layernorm.weight"))
        if pattern[ffn] == "E":
            maps += moe_maps(cfg, ffn, hf_layer, LayerNames())
            if cfg.moe.num_shared_experts:
                maps += mlp_maps(ffn, f"{hf_layer}.mlp.shared_expert", native="moe.shared_experts")
                maps.append(TensorMap.rename(f"layers.{ffn}.moe.shared_expert_gate.weight",
                                             f"{hf_layer}.mlp.shared_expert_gate.weight"))
        else:
            maps += mlp_maps(ffn, f"{hf_layer}.mlp")
    return maps


def mtp_layer_pattern(cfg: ModelConfig) -> str:
    """The hub's MTP layer: gated attention, then MoE when the backbone has any."""
    return "*E" if "E" in cfg.pattern else "*-"


def mtp_maps(cfg: ModelConfig) -> list[TensorMap]:
    mtp = cfg.mtp
    if mtp.stored_layers != 1 or mtp.pattern != mtp_layer_pattern(cfg):
        raise ValueError(f"qwen3_next: the hub holds one MTP layer of pattern {mtp_layer_pattern(cfg)!r}; got "
                         f"mtp.num_layers={mtp.num_layers} (shared: {mtp.shared}), mtp.pattern={mtp.pattern!r}")
    depth = [TensorMap.rename(f"{native}.weight", f"mtp.{hub}.weight") for native, hub in (
        ("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"), ("eh_proj", "fc"), ("final_norm", "norm"))]
    depth += qwen3_next_layer_maps(cfg, fused=True, prefix="mtp", pattern=mtp.pattern)
    return prefixed("mtp.depths.0.", depth)


class Qwen3Next(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        cfg = qwen3_next_model(hf, self.name, ARCH)
        depths = int(hf.get("mtp_num_hidden_layers") or 0)
        if depths:
            cfg.mtp = MTPConfig(num_layers=depths, pattern=mtp_layer_pattern(cfg), hub_weight_copies=False)
        return cfg

    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        """The checkpoint decides: transformers saves no ``mtp.*`` tensors (no depth), the hub one layer."""
        cfg = self.from_hf_config(hf)
        if not any(name.startswith("mtp.") for name in tensor_names):
            cfg.mtp = None
            return cfg
        layers = sorted({name.split(".")[2] for name in tensor_names if name.startswith("mtp.layers.")})
        if layers != ["0"]:
            raise ValueError(f"qwen3_next checkpoint: its mtp.* tensors hold MTP layers {layers}; one MTP layer "
                             "(mtp.layers.0) is supported")
        cfg.mtp = MTPConfig(num_layers=1, pattern=mtp_layer_pattern(cfg), hub_weight_copies=False)
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = qwen3_next_hf_config(cfg, self.name, ARCH, self.model_type)
        if cfg.mtp is not None:
            hf["mtp_num_hidden_layers"] = cfg.mtp.stored_layers
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_pattern(cfg, self.name)
        return embedding_maps(cfg) + qwen3_next_layer_maps(cfg, fused=True) + (mtp_maps(cfg) if cfg.mtp else [])


FAMILY = Qwen3Next(name="qwen3_next", architectures=(ARCH,), model_type="qwen3_next")
