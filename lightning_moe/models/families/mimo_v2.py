"""MiMo-V2 (``MiMoV2ForCausalLM``, model type ``mimo_v2``: MiMo-V2.5, V2.5-Pro, V2.6-Flash, V2.6-Pro).

Not in transformers 5.24; this translation is written from the hub config.json files and the public model code of
inference engines (vLLM's and SGLang's ``mimo_v2``, NeMo AutoModel's ``mimo_v25``), which agree on the layout below.
transformers' ``mimo_v2_flash`` (``MiMoV2FlashForCausalLM``) is the same network with another config and checkpoint
layout: its config names layers by ``layer_types`` / ``mlp_layer_types`` with per-type ``rope_parameters`` and fixes
the sliding layers' kv heads at twice ``num_key_value_heads``; its checkpoints hold split ``q_proj`` / ``k_proj`` /
``v_proj`` and ``sinks`` and no MTP layers; and it widens the window by one (SGLang attends ``sliding_window_size``
keys before the query). Here, as in AutoModel, vLLM and the checkpoints' own modeling code, a sliding layer attends
to ``sliding_window`` keys, the query's included.

One hub layer ``model.layers.{i}`` is our block pair ``(2i, 2i + 1)``: attention with ``input_layernorm``, then an
MoE (``moe_layer_freq[i] == 1``: sigmoid router with a selection-only ``e_score_correction_bias``, no shared expert)
or a dense SwiGLU MLP with ``post_attention_layernorm``. ``hybrid_layer_pattern[i] == 1`` marks a sliding-window
layer, whose attention has its own head counts and dims (``swa_*``), rope theta (``swa_rope_theta``) and, with
``add_swa_attention_sink_bias``, per-head sink logits (``attention_sink_bias``): ``ModelConfig.sliding_attention``.
Query/key heads are ``head_dim`` wide (192), value heads ``v_head_dim`` (128); values are multiplied by
``attention_value_scale``; rope turns the first ``int(head_dim * partial_rotary_factor)`` channels.

``attention_projection_layout: fused_qkv`` checkpoints (V2.5 and later) hold one ``self_attn.qkv_proj`` whose rows
are ``num_key_value_heads`` shards (the checkpoint's tensor-parallel ranks), shard ``s`` being ``[q_s | k_s | v_s]``
for its share of the heads; the maps here gather the shards' q, k and v rows into our split projections and back,
exactly. Other checkpoints hold split projections (family ``mimo_v2_split``).

MTP: ``model.mtp.layers.{d}`` (``num_nextn_predict_layers``, or as many as the checkpoint holds) are our MTP depths:
``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` and one sliding-window attention layer with a dense MLP
(``input_layernorm``, ``self_attn``, ``pre_mlp_layernorm``, ``mlp``).

Hub quantization (:mod:`lightning_moe.io.quantized`): V2.5-Pro stores every linear but ``o_proj``, the
router and ``eh_proj`` as 128x128 FP8 blocks (``fp8-block``), the fused QKV's shards each on their own tile grid;
V2.6 (``store_dtype: mxfp4``, ``fp8-mxfp4`` here) stores the routed experts as MXFP4 instead. The omni checkpoints'
vision and audio towers have no module here: import skips them, and says so.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MTPConfig, RopeConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    LayerNames,
    embedding_maps,
    llama_style_model,
    mlp_maps,
    moe_maps,
    prefixed,
    sigmoid_moe_from_hf,
)

ARCH = "MiMoV2ForCausalLM"
FUSED = "fused_qkv"
SPLIT = "mimo_v2_split"  # the family of split-projection checkpoints
# the omni checkpoints' encoders (their tensors are skipped on import)
TOWERS = ("visual.", "audio_encoder.", "audio_tokenizer.", "speech_embeddings.")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {**FP8_CONFIG, "store_dtype": "mxfp4", "mxfp4_block_size": 32}
# kept in bf16 (fp32 router) by the hub's FP8 layouts: besides norms and sinks (not ``.weight`` of a linear)
FP8_UNQUANTIZED = ("embed_tokens", "lm_head", "self_attn.o_proj", "mlp.gate.", "eh_proj", "norm.weight")


def _layers(hf: dict[str, Any], key: str, count: int, default: int) -> list[int]:
    """A per-layer 0/1 list of config.json (``hybrid_layer_pattern``, ``moe_layer_freq``)."""
    values = hf.get(key)
    if values is None:
        if key == "hybrid_layer_pattern" and hf.get("hybrid_block_size"):
            raise ValueError(f"config.json ({ARCH}): hybrid_block_size is not supported; list hybrid_layer_pattern")
        return [default] * count
    if not isinstance(values, list) or len(values) != count or set(values) - {0, 1}:
        raise ValueError(f"config.json ({ARCH}): {key} must list {count} values of 0 and 1, got {values!r}")
    return values


def _attention(hf: dict[str, Any], prefix: str, theta_key: str, sinks_key: str) -> AttentionConfig:
    """The full (``prefix=''``) or sliding (``'swa_'``) attention layers' settings."""
    head_dim = require(hf, f"{prefix}head_dim", ARCH)
    factor = float(hf.get("partial_rotary_factor", 1.0))
    if int(head_dim * factor) % 2:
        raise ValueError(f"config.json ({ARCH}): {prefix}head_dim={head_dim} x partial_rotary_factor={factor} "
                         "gives an odd rotary width")
    rope_type = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.json ({ARCH}): rope_type {rope_type!r} is not supported (default)")
    scale = hf.get("attention_value_scale")
    return AttentionConfig(
        num_heads=require(hf, f"{prefix}num_attention_heads", ARCH),
        num_kv_heads=require(hf, f"{prefix}num_key_value_heads", ARCH),
        head_dim=head_dim,
        v_head_dim=hf.get(f"{prefix}v_head_dim") or head_dim,
        value_scale=1.0 if scale is None else float(scale),
        qkv_bias=bool(hf.get("attention_bias", False)),
        sinks=bool(hf.get(sinks_key, False)),
        rope=RopeConfig(theta=float(require(hf, theta_key, ARCH)), partial_rotary_factor=factor),
    )


def mtp_depths(hf: dict[str, Any], tensor_names: Collection[str] | None = None) -> int:
    """MTP layers: those the checkpoint holds, else ``num_nextn_predict_layers`` (V2.5-Pro's config omits it)."""
    if tensor_names is None:
        return int(hf.get("num_nextn_predict_layers") or 0)
    return len({name.split(".")[3] for name in tensor_names if name.startswith("model.mtp.layers.")})


def mimo_v2_model(hf: dict[str, Any], family: str, depths: int) -> ModelConfig:
    layers = require(hf, "num_hidden_layers", ARCH)
    sliding = _layers(hf, "hybrid_layer_pattern", layers, 0)
    sparse = _layers(hf, "moe_layer_freq", layers, 0)
    pattern = "".join("*" + ("E" if s else "-") for s in sparse)
    attention = _attention(hf, "", "rope_theta", "add_full_attention_sink_bias")
    swa = None
    if any(sliding) or depths:  # the MTP layers' attention slides
        attention.sliding_window = require(hf, "sliding_window", ARCH, "sliding_window_size")
        attention.sliding_window_layers = [bool(s) for s in sliding] + ([True] if depths else [])
        swa = _attention(hf, "swa_", "swa_rope_theta", "add_swa_attention_sink_bias")
    moe = None
    if "E" in pattern:
        moe = sigmoid_moe_from_hf({**hf, "routed_scaling_factor": hf.get("routed_scaling_factor") or 1.0}, ARCH)
        if moe.num_shared_experts:
            raise ValueError(f"config.json ({ARCH}): n_shared_experts={moe.num_shared_experts}: MiMo-V2 has none")
        moe.bias_update_rate = 0.0  # AutoModel fine-tunes MiMo with its expert bias fixed
    eps = hf.get("layernorm_epsilon", hf.get("rms_norm_eps", 1e-5))
    return llama_style_model(
        {**hf, "rms_norm_eps": float(eps)}, family, ARCH, pattern, attention, sliding_attention=swa,
        mlp=MLPConfig(require(hf, "intermediate_size", ARCH)) if "-" in pattern or depths else None, moe=moe,
        mtp=MTPConfig(num_layers=depths, pattern="*-", hub_weight_copies=False) if depths else None,
    )


def check_model(cfg: ModelConfig, family: str) -> None:
    pairs = [cfg.pattern[i : i + 2] for i in range(0, len(cfg.pattern), 2)]
    if len(cfg.pattern) % 2 or any(p[0] != "*" or p[1] not in "-E" for p in pairs):
        raise ValueError(f"{family}: pattern {cfg.pattern!r} must be (attention, MLP or MoE) pairs like '*-*E'")
    full, swa = cfg.attention, cfg.sliding_attention or cfg.attention
    if full.type != "gqa" or full.out_bias or full.qkv_bias != swa.qkv_bias or full.value_scale != swa.value_scale \
            or full.rope.partial_rotary_factor != swa.rope.partial_rotary_factor or full.rope.type != "default":
        raise ValueError(f"{family}: attention must be GQA without an output bias, default rope, and share qkv_bias, "
                         "value_scale and partial_rotary_factor with sliding_attention (one config.json key each)")
    if cfg.mtp is not None and cfg.mtp.num_layers and (cfg.mtp.pattern != "*-" or cfg.mtp.hub_weight_copies
                                                       or full.window_for(len(pairs)) is None):
        raise ValueError(f"{family}: the hub's MTP layers are one sliding-window attention and a dense MLP each "
                         f"(mtp.pattern '*-', no weight copies), got {cfg.mtp.pattern!r}")


def mimo_v2_hf_config(cfg: ModelConfig, family: str, model_type: str, layout: str) -> dict[str, Any]:
    check_model(cfg, family)
    full, swa, moe = cfg.attention, cfg.sliding_attention or cfg.attention, cfg.moe
    layers = len(cfg.pattern) // 2
    hf: dict[str, Any] = {
        "architectures": [ARCH], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": layers, "hidden_act": "silu",
        "intermediate_size": cfg.mlp.intermediate_size if cfg.mlp else moe.intermediate_size,
        "layernorm_epsilon": cfg.norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_projection_layout": layout, "attention_bias": full.qkv_bias,
        "attention_value_scale": full.value_scale, "partial_rotary_factor": full.rope.partial_rotary_factor,
        "rope_theta": full.rope.theta, "swa_rope_theta": swa.rope.theta,
        "add_full_attention_sink_bias": full.sinks, "add_swa_attention_sink_bias": swa.sinks,
        "hybrid_layer_pattern": [int(full.window_for(i) is not None) for i in range(layers)],
        "moe_layer_freq": [int(s == "E") for s in cfg.pattern[1::2]],
        "num_nextn_predict_layers": cfg.mtp.stored_layers if cfg.mtp else 0,
    }
    for prefix, att in (("", full), ("swa_", swa)):
        hf.update({f"{prefix}num_attention_heads": att.num_heads, f"{prefix}num_key_value_heads": att.num_kv_heads,
                   f"{prefix}head_dim": att.head_dim, f"{prefix}v_head_dim": att.value_dim})
    if full.sliding_window is not None:
        hf.update(sliding_window=full.sliding_window, sliding_window_size=full.sliding_window)
    if moe is not None:
        hf.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                  moe_intermediate_size=moe.intermediate_size, n_shared_experts=None, scoring_func="sigmoid",
                  topk_method="noaux_tc", n_group=moe.n_group, topk_group=moe.topk_group,
                  norm_topk_prob=moe.norm_topk_prob,
                  # the hub writes null for no scaling
                  routed_scaling_factor=None if moe.routed_scaling_factor == 1.0 else moe.routed_scaling_factor)
    return hf


# ---------------------------------------------------------------------------------------------- weights
def fused_qkv_map(att: AttentionConfig, shards: int, native: str, hub: str, suffix: str) -> TensorMap:
    """``qkv_proj`` (``shards`` row blocks ``[q_s | k_s | v_s]``) <-> our q, k and v projections (``suffix``:
    ``weight`` or ``bias``)."""
    if att.num_heads % shards or att.num_kv_heads % shards:
        raise ValueError(f"mimo_v2: the fused qkv_proj is split in {shards} shards (num_key_value_heads), which must "
                         f"divide {att.num_heads} heads and {att.num_kv_heads} kv heads")
    sizes = [att.num_heads // shards * att.head_dim, att.num_kv_heads // shards * att.head_dim,
             att.num_kv_heads // shards * att.value_dim]

    def to_native(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        fused = tensors[0]
        parts = fused.reshape(shards, sum(sizes), *fused.shape[1:]).split(sizes, dim=1)
        return tuple(p.reshape(-1, *fused.shape[1:]).contiguous() for p in parts)

    def to_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        parts = [t.reshape(shards, -1, *t.shape[1:]) for t in (q, k, v)]
        return [torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])]

    return TensorMap(f"{native}.q_proj.{suffix}", (f"{hub}.qkv_proj.{suffix}",), to_native, to_hf,
                     joint=(f"{native}.k_proj.{suffix}", f"{native}.v_proj.{suffix}"))


def attention_maps(cfg: ModelConfig, att: AttentionConfig, block: int, hf_layer: str, fused: bool) -> list[TensorMap]:
    native, hub = f"layers.{block}.attn", f"{hf_layer}.self_attn"
    maps = [TensorMap.rename(f"{native}.o_proj.weight", f"{hub}.o_proj.weight")]
    for suffix in ("weight", "bias") if att.qkv_bias else ("weight",):
        if fused:
            maps.append(fused_qkv_map(att, cfg.attention.num_kv_heads, native, hub, suffix))
        else:
            maps += [TensorMap.rename(f"{native}.{p}.{suffix}", f"{hub}.{p}.{suffix}") for p in ("q_proj", "k_proj", "v_proj")]
    if att.sinks:
        maps.append(TensorMap.rename(f"{native}.sinks", f"{hub}.attention_sink_bias"))
    return maps


def layer_maps(cfg: ModelConfig, pattern: str, attention_index: int, hf_layer: str, fused: bool,
               post_attention_norm: str = "post_attention_layernorm") -> list[TensorMap]:
    """One hub layer: our blocks 0 and 1 of ``pattern`` (the caller prefixes the block names)."""
    maps = [TensorMap.rename("layers.0.norm.weight", f"{hf_layer}.input_layernorm.weight"),
            TensorMap.rename("layers.1.norm.weight", f"{hf_layer}.{post_attention_norm}.weight")]
    maps += attention_maps(cfg, cfg.attention_for(attention_index), 0, hf_layer, fused)
    if pattern[1] == "E":
        maps += moe_maps(cfg, 1, hf_layer, LayerNames())
        maps.append(TensorMap.rename("layers.1.moe.router.score_correction_bias",
                                     f"{hf_layer}.mlp.gate.e_score_correction_bias"))
    else:
        maps += mlp_maps(1, f"{hf_layer}.mlp")
    return maps


def _shift_blocks(maps: list[TensorMap], first: int) -> list[TensorMap]:
    """``layers.0`` / ``layers.1`` of :func:`layer_maps` as our blocks ``first`` and ``first + 1``."""
    def shift(name: str) -> str:
        head, index, rest = name.split(".", 2)
        return f"{head}.{int(index) + first}.{rest}"

    return [TensorMap(shift(m.native), m.hf, m.to_native, m.to_hf, tuple(shift(n) for n in m.joint)) for m in maps]


def mimo_v2_weight_map(cfg: ModelConfig, family: str, fused: bool) -> list[TensorMap]:
    check_model(cfg, family)
    layers = len(cfg.pattern) // 2
    maps = embedding_maps(cfg)
    for i in range(layers):
        maps += _shift_blocks(layer_maps(cfg, cfg.pattern[2 * i : 2 * i + 2], i, f"model.layers.{i}", fused), 2 * i)
    for d in range(cfg.mtp.stored_layers if cfg.mtp else 0):
        hub = f"model.mtp.layers.{d}"
        depth = [TensorMap.rename(f"{ours}.weight", f"{hub}.{theirs}.weight") for ours, theirs in (
            ("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_norm", "final_layernorm"))]
        depth += layer_maps(cfg, cfg.mtp.pattern, layers, hub, fused, post_attention_norm="pre_mlp_layernorm")
        maps += prefixed(f"mtp.depths.{d}.", depth)
    return maps


class MiMoV2(Family):
    """The layout follows the config's family: ``mimo_v2`` fused QKV, ``mimo_v2_split`` split projections."""

    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        return mimo_v2_model(hf, layout_family(hf), mtp_depths(hf))

    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        return mimo_v2_model(hf, layout_family(hf), mtp_depths(hf, tensor_names))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return mimo_v2_hf_config(cfg, cfg.family, self.model_type, "split" if cfg.family == SPLIT else FUSED)

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        return mimo_v2_weight_map(cfg, cfg.family, fused=cfg.family != SPLIT)

    def hf_quantization_config(self, method: str) -> dict[str, Any] | None:
        return {"fp8-block": dict(FP8_CONFIG), "fp8-mxfp4": dict(MXFP4_CONFIG)}.get(method)

    def quantizes(self, hf_name: str, method: str) -> bool:
        linear = hf_name.endswith(".weight") and not any(p in hf_name for p in FP8_UNQUANTIZED)
        return method in ("fp8-block", "fp8-mxfp4") and linear

    def hub_encoding(self, hf_name: str, method: str) -> str | None:
        if not self.quantizes(hf_name, method):
            return None
        return "mxfp4" if method == "fp8-mxfp4" and ".mlp.experts." in hf_name else "fp8-block"

    def quantization_row_shards(self, hf_name: str, hf: dict[str, Any]) -> int:
        if hf_name.endswith("self_attn.qkv_proj.weight"):
            return int(require(hf, "num_key_value_heads", ARCH))
        return 1


def layout_family(hf: dict[str, Any]) -> str:
    return "mimo_v2" if hf.get("attention_projection_layout") == FUSED else SPLIT


FAMILY = MiMoV2(name="mimo_v2", architectures=(ARCH,), model_type="mimo_v2",
                ignored_hf_tensors=("rotary_emb.inv_freq", *TOWERS))
# split q/k/v checkpoints: found by family name, never by architecture
VARIANTS = (MiMoV2(name=SPLIT, architectures=(), model_type="mimo_v2",
                   ignored_hf_tensors=FAMILY.ignored_hf_tensors),)
