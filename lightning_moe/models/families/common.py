"""Translations shared across families: rope settings, the standard decoder-layer names, Llama-style configs,
and DeepSeek-style MoE settings and MLA weights (used by DeepSeek-V3, GLM-4.5, Kimi-Linear, MiMo-V2).

A Llama-style hub layer ``model.layers.{i}`` holds ``self_attn`` + ``input_layernorm`` (our block ``2i``)
and ``mlp`` + ``post_attention_layernorm`` (our block ``2i + 1``, a dense MLP or an MoE).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_moe.models.config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
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


# ---------------------------------------------------------------------------------------------- Llama-style configs
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


# ---------------------------------------------------------------------------------------------- DeepSeek-style MoE
# DeepSeek-V3's bias update speed (gamma); GLM-4.5 uses the same
BIAS_UPDATE_RATE = 1e-3


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


def prefixed(prefix: str, maps: list[TensorMap]) -> list[TensorMap]:
    """``maps`` with ``prefix`` before every native name (an MTP depth's)."""
    return [dataclasses.replace(m, native=prefix + m.native, joint=tuple(prefix + n for n in m.joint)) for m in maps]
