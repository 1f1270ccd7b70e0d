"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention and NoPE MLA layers, DeepSeek-V3's MoE.

One hub layer ``model.layers.{i}`` is our block pair ``(2i, 2i + 1)``: the token mixer ``self_attn`` (``K`` KDA for
``linear_attention``, ``*`` MLA without positional embedding for ``full_attention``) with ``input_layernorm``,
then a dense MLP (``mlp``) or an MoE (``block_sparse_moe``: sigmoid router with ``e_score_correction_bias``,
group-limited top-k, shared experts, experts ``w1``/``w3``/``w2``) with ``post_attention_layernorm``.

The hub's config.json keeps the layer split in ``linear_attn_config`` (1-indexed ``kda_layers`` /
``full_attn_layers``) and names the MoE keys its own way (``num_experts``, ``num_experts_per_token``,
``moe_renormalize``, ``num_expert_group``, ``num_shared_experts``); both spellings read. Its KDA conv is three
tensors (``q_conv1d``, ``k_conv1d``, ``v_conv1d``), one conv over ``q | k | v`` here; ``A_log`` is stored
``[1, 1, heads, 1]``. transformers saves dense layers under ``block_sparse_moe`` too (it renames them on load):
such checkpoints import as family ``kimi_linear_transformers``, which writes them back the same way; the hub's
layout (``mlp``) is family ``kimi_linear``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_moe.models.config import (
    AttentionConfig,
    LinearAttentionConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    BIAS_UPDATE_RATE,
    LayerNames,
    base_hf_config,
    llama_style_model,
    mla_maps,
    mlp_maps,
    moe_maps,
)

ARCH = "KimiLinearForCausalLM"
MIXERS = {"linear_attention": "K", "full_attention": "*"}
LAYER_TYPES = {v: k for k, v in MIXERS.items()}
NAMES = LayerNames(ffn="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2")
CHUNK_SIZE = 64
TRANSFORMERS_LAYOUT = "kimi_linear_transformers"
LATENT_NORM_EPS = 1e-6  # transformers' MLA builds its latent norms with the default epsilon


def setting(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` config.json sets (the hub's names, then transformers' attribute names)."""
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def layer_types_from_hf(hf: dict[str, Any]) -> list[str]:
    layers = require(hf, "num_hidden_layers", ARCH)
    split = hf.get("linear_attn_config") or {}
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
    elif "kda_layers" in split and "full_attn_layers" in split:
        types = [None] * layers
        for i in split["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in split["kda_layers"]:
            types[i - 1] = "linear_attention"
    else:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    unknown = sorted({str(t) for t in types} - set(MIXERS))
    if unknown or len(types) != layers:
        raise ValueError(f"config.json ({ARCH}): layer types must be {layers} of {sorted(MIXERS)}, got {len(types)} "
                         f"with unknown {unknown} (layer_types, or linear_attn_config's kda_layers/full_attn_layers)")
    return types


def mlp_types_from_hf(hf: dict[str, Any], layers: int) -> list[str]:
    if hf.get("mlp_layer_types"):
        return list(hf["mlp_layer_types"])
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json ({ARCH}): moe_layer_freq={hf['moe_layer_freq']} is not supported (1)")
    dense = setting(hf, "first_k_dense_replace", default=1)
    return ["dense" if i < dense else "sparse" for i in range(layers)]


def kda_from_hf(hf: dict[str, Any]) -> LinearAttentionConfig:
    split = hf.get("linear_attn_config") or {}
    heads = setting(split, "num_heads") or require(hf, "linear_num_heads", ARCH)
    dim = setting(split, "head_dim") or require(hf, "linear_head_dim", ARCH)
    return LinearAttentionConfig(
        num_k_heads=heads, num_v_heads=heads, head_k_dim=dim, head_v_dim=dim,
        conv_kernel=setting(split, "short_conv_kernel_size") or hf.get("linear_conv_kernel_dim", 4),
        chunk_size=CHUNK_SIZE, norm_eps=hf.get("rms_norm_eps", 1e-5),
    )


def mla_from_hf(hf: dict[str, Any]) -> AttentionConfig:
    heads = require(hf, "num_attention_heads", ARCH)
    rope_dim = require(hf, "qk_rope_head_dim", ARCH)
    bias = bool(hf.get("attention_bias", False))
    return AttentionConfig(
        type="mla", num_heads=heads, num_kv_heads=heads, head_dim=rope_dim, qkv_bias=bias, out_bias=False,
        rope=RopeConfig(type="none"), q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=require(hf, "kv_lora_rank", ARCH), qk_nope_head_dim=require(hf, "qk_nope_head_dim", ARCH),
        qk_rope_head_dim=rope_dim, v_head_dim=require(hf, "v_head_dim", ARCH), latent_norm_eps=LATENT_NORM_EPS,
    )


def moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    scoring = setting(hf, "moe_router_activation_func", "scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"config.json ({ARCH}): moe_router_activation_func={scoring!r} is not supported (sigmoid)")
    experts_key = ("num_experts", "num_local_experts", "n_routed_experts")
    return MoEConfig(
        num_experts=setting(hf, *experts_key) or require(hf, experts_key[0], ARCH),
        top_k=setting(hf, "num_experts_per_token", "num_experts_per_tok") or require(hf, "num_experts_per_token", ARCH),
        intermediate_size=require(hf, "moe_intermediate_size", ARCH),
        num_shared_experts=int(setting(hf, "num_shared_experts", "n_shared_experts", default=0)),
        score_func="sigmoid",
        n_group=int(setting(hf, "num_expert_group", "n_group", default=1)),
        topk_group=int(setting(hf, "topk_group", default=1)),
        norm_topk_prob=bool(setting(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(setting(hf, "routed_scaling_factor", default=1.0)),
        score_correction_bias=True,
        bias_update_rate=BIAS_UPDATE_RATE,
    )


class KimiLinear(Family):
    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        cfg = self.from_hf_config(hf)
        dense = [f"model.layers.{i}.block_sparse_moe.gate_proj.weight" for i, s in enumerate(cfg.pattern[1::2])
                 if s == "-"]
        if dense and dense[0] in tensor_names:
            cfg.family = TRANSFORMERS_LAYOUT
        return cfg

    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        if not hf.get("mla_use_nope", True):  # the hub's config.json says true; transformers' model is NoPE only
            raise ValueError(f"{ARCH}: mla_use_nope=false (rotary MLA layers) is not supported; Kimi-Linear's "
                             "MLA layers are NoPE, and so are transformers' and this package's")
        types = layer_types_from_hf(hf)
        ffn = mlp_types_from_hf(hf, len(types))
        pattern = "".join(MIXERS[t] + ("E" if f == "sparse" else "-") for t, f in zip(types, ffn))
        cfg = llama_style_model(
            hf, self.name, ARCH, pattern, mla_from_hf(hf),
            mlp=MLPConfig(require(hf, "intermediate_size", ARCH)) if "-" in pattern else None,
            moe=moe_from_hf(hf) if "E" in pattern else None,
            linear_attention=kda_from_hf(hf) if "K" in pattern else None,
        )
        cfg.norm_eps = hf.get("rms_norm_eps", 1e-5)
        cfg.max_position_embeddings = setting(hf, "model_max_length", "max_position_embeddings", default=4096)
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        check_pattern(cfg, self.name)
        att, mixers, ffn = cfg.attention, cfg.pattern[0::2], cfg.pattern[1::2]
        hf = base_hf_config(cfg, ARCH, self.model_type)
        del hf["rope_parameters"]  # NoPE
        hf.update(
            num_hidden_layers=len(mixers),
            layer_types=[LAYER_TYPES[s] for s in mixers],
            mlp_layer_types=["sparse" if s == "E" else "dense" for s in ffn],
            model_max_length=hf.pop("max_position_embeddings"),
            intermediate_size=cfg.mlp.intermediate_size if cfg.mlp else cfg.moe.intermediate_size,
            q_lora_rank=att.q_lora_rank, kv_lora_rank=att.kv_lora_rank, qk_nope_head_dim=att.qk_nope_head_dim,
            qk_rope_head_dim=att.qk_rope_head_dim, v_head_dim=att.v_head_dim, attention_bias=att.qkv_bias,
        )
        la = cfg.linear_attention
        if la is not None:
            hf.update(linear_num_heads=la.num_v_heads, linear_head_dim=la.head_v_dim,
                      linear_conv_kernel_dim=la.conv_kernel)
        moe = cfg.moe
        if moe is not None:
            hf.update(num_experts=moe.num_experts, num_experts_per_token=moe.top_k,
                      moe_intermediate_size=moe.intermediate_size, num_shared_experts=moe.num_shared_experts,
                      num_expert_group=moe.n_group, topk_group=moe.topk_group, moe_renormalize=moe.norm_topk_prob,
                      routed_scaling_factor=moe.routed_scaling_factor)
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_pattern(cfg, self.name)
        maps = [TensorMap.rename("embed.weight", "model.embed_tokens.weight"),
                TensorMap.rename("norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            maps.append(TensorMap.rename("lm_head.weight", "lm_head.weight"))
        for i in range(len(cfg.pattern) // 2):
            hub, mixer, ffn = f"model.layers.{i}", 2 * i, 2 * i + 1
            maps += kda_maps(cfg, mixer, hub) if cfg.pattern[mixer] == "K" else mla_maps(cfg, mixer, hub)
            maps.append(TensorMap.rename(f"layers.{ffn}.norm.weight", f"{hub}.post_attention_layernorm.weight"))
            if cfg.pattern[ffn] == "E":
                maps += moe_maps(cfg, ffn, hub, NAMES)
                maps.append(TensorMap.rename(f"layers.{ffn}.moe.router.score_correction_bias",
                                             f"{hub}.block_sparse_moe.gate.e_score_correction_bias"))
                if cfg.moe.num_shared_experts:
                    maps += mlp_maps(ffn, f"{hub}.block_sparse_moe.shared_experts", native="moe.shared_experts")
            else:
                maps += mlp_maps(ffn, f"{hub}.{'block_sparse_moe' if cfg.family == TRANSFORMERS_LAYOUT else 'mlp'}")
        return maps


def check_pattern(cfg: ModelConfig, family: str) -> None:
    pairs = [cfg.pattern[i : i + 2] for i in range(0, len(cfg.pattern), 2)]
    if len(cfg.pattern) % 2 or any(p[0] not in "*K" or p[1] not in "-E" for p in pairs):
        raise ValueError(f"{family}: pattern {cfg.pattern!r} must be (MLA or KDA, MLP or MoE) pairs like 'K-KE*E'")
    if "*" in cfg.pattern and (cfg.attention.type != "mla" or cfg.attention.rope.type != "none"):
        raise ValueError(f"{family}: attention must be MLA without rope ({ARCH}'s full-attention layers are NoPE)")


def kda_maps(cfg: ModelConfig, block: int, hub_layer: str) -> list[TensorMap]:
    native, hub = f"layers.{block}.kda", f"{hub_layer}.self_attn"
    heads = cfg.linear_attention.num_v_heads

    def convs_to_native(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors))

    def conv_to_hf(tensor: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for t in tensor.chunk(3)]

    maps = [TensorMap.rename(f"layers.{block}.norm.weight", f"{hub_layer}.input_layernorm.weight"),
            TensorMap(f"{native}.conv1d.weight", tuple(f"{hub}.{p}_conv1d.weight" for p in "qkv"),
                      convs_to_native, conv_to_hf),
            TensorMap(f"{native}.A_log", (f"{hub}.A_log",), lambda t: t[0].reshape(heads),
                      lambda t: [t.reshape(1, 1, heads, 1)])]
    for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm"):
        maps.append(TensorMap.rename(f"{native}.{name}.weight", f"{hub}.{name}.weight"))
    maps.append(TensorMap.rename(f"{native}.out_proj.weight", f"{hub}.o_proj.weight"))
    maps.append(TensorMap.rename(f"{native}.dt_bias", f"{hub}.dt_bias"))
    return maps


FAMILY = KimiLinear(name="kimi_linear", architectures=(ARCH,), model_type="kimi_linear")
# checkpoints saved by transformers (dense layers under ``block_sparse_moe``): found by name, never by architecture
VARIANTS = (KimiLinear(name=TRANSFORMERS_LAYOUT, architectures=(), model_type="kimi_linear"),)
