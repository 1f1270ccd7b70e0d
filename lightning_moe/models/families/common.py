"""Translations shared by the Llama-style families: rope settings and the standard decoder-layer names.

A Llama-style hub layer ``model.layers.{i}`` holds ``self_attn`` + ``input_layernorm`` (our block ``2i``)
and ``mlp`` + ``post_attention_layernorm`` (our block ``2i + 1``, a dense MLP or an MoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_moe.models.config import AttentionConfig, ModelConfig, RopeConfig
from lightning_moe.models.families.base import TensorMap, require, rope_parameters

SUPPORTED_ROPE = ("default", "llama3", "yarn")
# transformers' Qwen2/Qwen3 default: layers before this one never slide
QWEN_MAX_WINDOW_LAYERS = 28


def rope_from_hf(hf: dict[str, Any], architecture: str) -> RopeConfig:
    params = rope_parameters(hf)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"config.json ({architecture}): rope_type {kind!r} is not supported ({', '.join(SUPPORTED_ROPE)})")
    rope = RopeConfig(type=kind, theta=float(params["rope_theta"]))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor", "partial_rotary_factor"):
        if params.get(key) is not None:
            setattr(rope, key, float(params[key]))
    if params.get("original_max_position_embeddings") is not None:
        rope.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    elif kind in ("llama3", "yarn") and hf.get("max_position_embeddings") is not None:
        # transformers' default: the model was pretrained at its full length
        rope.original_max_position_embeddings = int(hf["max_position_embeddings"])
    if kind == "yarn" and params.get("factor") is None and rope.original_max_position_embeddings:
        # as transformers does: the context extension is the ratio of the two lengths
        rope.factor = hf["max_position_embeddings"] / rope.original_max_position_embeddings
    if "truncate" in params:
        rope.truncate = bool(params["truncate"])
    if hf.get("partial_rotary_factor") is not None:
        rope.partial_rotary_factor = float(hf["partial_rotary_factor"])
    return rope


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type == "llama3":
        params.update(
            factor=rope.factor,
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    elif rope.type == "yarn":
        params.update(
            factor=rope.factor,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            truncate=rope.truncate,
        )
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(rope, key) is not None:
                params[key] = getattr(rope, key)
    if rope.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = rope.partial_rotary_factor
    return params


def sliding_window_from_hf(hf: dict[str, Any], attention: AttentionConfig, layer_types: list[str] | None = None) -> None:
    """``sliding_window`` in every attention layer (Mixtral), or in those ``layer_types`` calls sliding (GPT-OSS)."""
    window = hf.get("sliding_window")
    if window is None:
        return
    attention.sliding_window = int(window)
    if layer_types:
        attention.sliding_window_layers = [t == "sliding_attention" for t in layer_types]


def qwen_sliding_window_from_hf(hf: dict[str, Any], attention: AttentionConfig, architecture: str,
                                per_layer: bool = True) -> None:
    """Qwen's rules, as transformers' configs apply them: no window unless ``use_sliding_window`` (default
    False); then Qwen2/Qwen3 slide in the layers ``layer_types`` names, by default those from
    ``max_window_layers`` on, and Qwen3-MoE (``per_layer=False``) in every layer."""
    if not hf.get("use_sliding_window", False):
        return
    layer_types = None
    if per_layer:
        first = hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(require(hf, "num_hidden_layers", architecture))
        ]
    sliding_window_from_hf(hf, attention, layer_types)


def base_hf_config(cfg: ModelConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """Keys every Llama-style transformers config has."""
    att = cfg.attention
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.pattern.count("*"),
        "num_attention_heads": att.num_heads,
        "num_key_value_heads": att.num_kv_heads,
        "head_dim": att.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope_to_hf(att.rope),
        "hidden_act": "silu",
    }


@dataclass
class LayerNames:
    """Hub names inside one Llama-style layer, for the parts that differ between families."""

    ffn: str = "mlp"  # Mixtral: block_sparse_moe
    router: str = "gate"
    expert_gate: str = "gate_proj"  # Mixtral: w1
    expert_up: str = "up_proj"  # Mixtral: w3
    expert_down: str = "down_proj"  # Mixtral: w2


def embedding_maps(cfg: ModelConfig, prefix: str = "model") -> list[TensorMap]:
    maps = [
        TensorMap.rename("embed.weight", f"{prefix}.embed_tokens.weight"),
        TensorMap.rename("norm.weight", f"{prefix}.norm.weight"),
    ]
    if not cfg.tie_embeddings:
        maps.append(TensorMap.rename("lm_head.weight", "lm_head.weight"))
    return maps


def attention_maps(cfg: ModelConfig, block: int, hf_layer: str) -> list[TensorMap]:
    att = cfg.attention
    maps = [TensorMap.rename(f"layers.{block}.norm.weight", f"{hf_layer}.input_layernorm.weight")]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        maps.append(TensorMap.rename(f"layers.{block}.attn.{proj}.weight", f"{hf_layer}.self_attn.{proj}.weight"))
        has_bias = att.out_bias if proj == "o_proj" else att.qkv_bias
        if has_bias:
            maps.append(TensorMap.rename(f"layers.{block}.attn.{proj}.bias", f"{hf_layer}.self_attn.{proj}.bias"))
    if att.qk_norm:
        for norm in ("q_norm", "k_norm"):
            maps.append(TensorMap.rename(f"layers.{block}.attn.{norm}.weight", f"{hf_layer}.self_attn.{norm}.weight"))
    if att.sinks:
        maps.append(TensorMap.rename(f"layers.{block}.attn.sinks", f"{hf_layer}.self_attn.sinks"))
    return maps


def mlp_maps(block: int, hf_mlp: str, native: str = "mlp", gated: bool = True, bias: bool = False) -> list[TensorMap]:
    maps = []
    for proj in ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", "down_proj"):
        maps.append(TensorMap.rename(f"layers.{block}.{native}.{proj}.weight", f"{hf_mlp}.{proj}.weight"))
        if bias:
            maps.append(TensorMap.rename(f"layers.{block}.{native}.{proj}.bias", f"{hf_mlp}.{proj}.bias"))
    return maps


def moe_maps(cfg: ModelConfig, block: int, hf_layer: str, names: LayerNames) -> list[TensorMap]:
    moe = cfg.moe
    hf_moe = f"{hf_layer}.{names.ffn}"
    native = f"layers.{block}.moe"
    maps = [TensorMap.rename(f"{native}.router.weight", f"{hf_moe}.{names.router}.weight")]
    experts = range(moe.num_experts)
    for ours, theirs in (("gate_proj", names.expert_gate), ("up_proj", names.expert_up), ("down_proj", names.expert_down)):
        if ours == "gate_proj" and moe.activation == "relu2":
            continue
        maps.append(TensorMap.stacked(f"{native}.experts.{ours}", [f"{hf_moe}.experts.{e}.{theirs}.weight" for e in experts]))
    return maps


def llama_style_layer_maps(cfg: ModelConfig, names: LayerNames | None = None, prefix: str = "model") -> list[TensorMap]:
    """All layers of a pattern made of (attention, MLP-or-MoE) pairs."""
    names = names or LayerNames()
    maps = []
    for i in range(len(cfg.pattern) // 2):
        hf_layer = f"{prefix}.layers.{i}"
        attn_block, ffn_block = 2 * i, 2 * i + 1
        maps += attention_maps(cfg, attn_block, hf_layer)
        maps.append(TensorMap.rename(f"layers.{ffn_block}.norm.weight", f"{hf_layer}.post_attention_layernorm.weight"))
        if cfg.pattern[ffn_block] == "E":
            maps += moe_maps(cfg, ffn_block, hf_layer, names)
        else:
            maps += mlp_maps(ffn_block, f"{hf_layer}.mlp", bias=cfg.mlp.bias)
    return maps


def check_llama_style_pattern(cfg: ModelConfig, family: str) -> None:
    pairs = [cfg.pattern[i : i + 2] for i in range(0, len(cfg.pattern), 2)]
    if len(cfg.pattern) % 2 or any(p[0] != "*" or p[1] not in "-E" for p in pairs):
        raise ValueError(f"{family}: pattern {cfg.pattern!r} must be (attention, MLP or MoE) pairs like '*-*E'")


def aux_loss_coeff_from_hf(hf: dict[str, Any], cfg: ModelConfig) -> float:
    """Our coefficient for transformers' ``router_aux_loss_coef``.

    transformers adds its load-balancing loss only with ``output_router_logits``, as one loss over the tokens of
    all layers, whose routed fractions count each of the ``top_k`` slots; ours is Megatron's, per layer, fractions
    normalized by ``top_k`` and summed over the layers. The same strength is ``coef * top_k / moe_layers``.
    """
    if not hf.get("output_router_logits"):
        return 0.0
    return float(hf.get("router_aux_loss_coef") or 0.0) * cfg.moe.top_k / max(cfg.pattern.count("E"), 1)


def aux_loss_coeff_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``router_aux_loss_coef`` / ``output_router_logits`` for our ``moe.aux_loss_coeff`` (see above)."""
    moe = cfg.moe
    coef = moe.aux_loss_coeff * max(cfg.pattern.count("E"), 1) / moe.top_k
    return {"router_aux_loss_coef": coef, "output_router_logits": moe.aux_loss_coeff > 0}
