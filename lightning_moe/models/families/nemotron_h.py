"""Nemotron-H (``NemotronHForCausalLM``): Mamba-2, attention, squared-ReLU MLP and (latent) MoE layers, plus MTP.

One hub layer ``backbone.layers.{i}`` is one pattern symbol: a ``norm`` and a ``mixer``, which is a Mamba-2
mixer (``M``), attention without positional embedding (``*``), a squared-ReLU MLP (``-``) or an MoE (``E``:
sigmoid router with expert bias, group-limited top-k, one shared expert, squared-ReLU experts, optional latent
projection). The pattern comes from ``layers_block_type`` (or the older ``hybrid_override_pattern`` string).

MTP depth ``d`` runs the inner pattern ``mtp_layers_block_type`` (length ``L``); the hub stores its layers flat
as ``mtp.layers.{d*L + j}``, named like backbone layers, with ``eh_proj``/``enorm``/``hnorm`` on the first inner
layer of a depth and ``final_layernorm`` on the last. transformers' model does not build these layers and
drops their tensors, so a checkpoint it saved imports without MTP.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from lightning_moe.models.config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
)
from lightning_moe.models.families.base import Family, TensorMap, require

ARCH = "NemotronHForCausalLM"
HUB_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
# older names of the same layer types
SYMBOLS = {**{v: k for k, v in HUB_LAYER_TYPES.items()}, "mamba": "M", "attention": "*"}
MTP_LOSS_SCALE = 0.3  # Megatron-Bridge's Nemotron recipes
# transformers' defaults for keys a config.json may leave out
DEFAULTS = {"conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "time_step_min": 0.001,
            "time_step_max": 0.1, "time_step_floor": 1e-4, "layer_norm_epsilon": 1e-5, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0, "mlp_bias": False, "head_dim": 128,
            "num_key_value_heads": 8}
# older config.json spellings (transformers maps them on load)
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
           "use_conv_bias": "mamba_conv_bias", "time_step_min": "mamba_dt_min", "time_step_max": "mamba_dt_max",
           "time_step_floor": "mamba_dt_init_floor"}


def setting(hf: dict[str, Any], key: str) -> Any:
    for name in (key, ALIASES.get(key)):
        if name is not None and hf.get(name) is not None:
            return hf[name]
    return DEFAULTS[key]


def pattern_from_hf(value: str | Sequence[str], key: str) -> str:
    """A list of layer types, or a pattern string like ``"M-M*-E"`` (``|`` marks pipeline stages in Megatron)."""
    if isinstance(value, str):
        pattern = value.replace("|", "")
        unknown = sorted(set(pattern) - set(HUB_LAYER_TYPES))
    else:
        unknown = sorted({t for t in value if t not in SYMBOLS})
        pattern = "" if unknown else "".join(SYMBOLS[t] for t in value)
    if unknown:
        raise ValueError(
            f"config.json ({ARCH}): {key} has unknown layer types {unknown}; "
            f"known: {sorted(SYMBOLS)} or the symbols {''.join(HUB_LAYER_TYPES)}"
        )
    return pattern


def check_activation(hf: dict[str, Any], key: str, supported: str) -> None:
    act = hf.get(key, supported)
    if act != supported:
        raise ValueError(f"config.json ({ARCH}): {key}={act!r} is not supported ({supported})")


def mamba_from_hf(hf: dict[str, Any]) -> MambaConfig:
    check_activation(hf, "mamba_hidden_act", "silu")
    return MambaConfig(
        num_heads=require(hf, "mamba_num_heads", ARCH),
        head_dim=require(hf, "mamba_head_dim", ARCH),
        state_size=require(hf, "ssm_state_size", ARCH),
        n_groups=require(hf, "n_groups", ARCH, "mamba_n_groups"),
        conv_kernel=setting(hf, "conv_kernel"),
        chunk_size=setting(hf, "chunk_size"),
        conv_bias=bool(setting(hf, "use_conv_bias")),
        proj_bias=bool(setting(hf, "use_bias")),
        # transformers' NemotronH mixer clamps dt to [time_step_min, inf), whatever time_step_limit says
        time_step_limit=(float(setting(hf, "time_step_min")), float("inf")),
        time_step_min=float(setting(hf, "time_step_min")),
        time_step_max=float(setting(hf, "time_step_max")),
        time_step_floor=float(setting(hf, "time_step_floor")),
        norm_eps=float(setting(hf, "layer_norm_epsilon")),
    )


def moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=require(hf, "n_routed_experts", ARCH, "num_local_experts"),
        top_k=require(hf, "num_experts_per_tok", ARCH),
        intermediate_size=require(hf, "moe_intermediate_size", ARCH),
        activation="relu2",
        # transformers builds one shared expert of this width whatever n_shared_experts says
        num_shared_experts=1,
        shared_intermediate_size=require(hf, "moe_shared_expert_intermediate_size", ARCH),
        score_func="sigmoid",
        n_group=int(setting(hf, "n_group")),
        topk_group=int(setting(hf, "topk_group")),
        norm_topk_prob=bool(setting(hf, "norm_topk_prob")),
        routed_scaling_factor=float(setting(hf, "routed_scaling_factor")),
        score_correction_bias=True,
        # Megatron-Bridge's training settings: expert-bias balancing at rate 1e-3 and a 1e-4 auxiliary loss
        bias_update_rate=1e-3,
        aux_loss_coeff=1e-4,
        latent_size=hf.get("moe_latent_size"),
        shared_latent_bias=bool(setting(hf, "mlp_bias")),
    )


class NemotronH(Family):
    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        pattern = pattern_from_hf(require(hf, "layers_block_type", ARCH, "hybrid_override_pattern"), "layers_block_type")
        depths = int(hf.get("num_nextn_predict_layers") or 0)
        mtp = None
        if depths:
            inner = hf.get("mtp_layers_block_type") or hf.get("mtp_hybrid_override_pattern") or ["full_attention", "moe"]
            mtp = MTPConfig(num_layers=depths, pattern=pattern_from_hf(inner, "mtp_layers_block_type"),
                            loss_scale=MTP_LOSS_SCALE)
        used = pattern + (mtp.pattern if mtp else "")
        check_activation(hf, "mlp_hidden_act", "relu2")
        heads = require(hf, "num_attention_heads", ARCH)
        hidden = require(hf, "hidden_size", ARCH)
        # transformers' NemotronH attention has no biases and no sliding window, whatever the config says
        attention = AttentionConfig(
            num_heads=heads,
            num_kv_heads=int(setting(hf, "num_key_value_heads")),
            head_dim=int(setting(hf, "head_dim")),
            rope=RopeConfig(type="none"),
        )
        mlp = None
        if "-" in used:
            mlp = MLPConfig(require(hf, "intermediate_size", ARCH), "relu2", bool(setting(hf, "mlp_bias")))
        return ModelConfig(
            family=self.name,
            vocab_size=require(hf, "vocab_size", ARCH),
            hidden_size=hidden,
            pattern=pattern,
            attention=attention,
            mlp=mlp,
            moe=moe_from_hf(hf) if "E" in used else None,
            mamba=mamba_from_hf(hf) if "M" in used else None,
            mtp=mtp,
            norm_eps=float(setting(hf, "layer_norm_epsilon")),
            norm_weight_fp32=True,
            # transformers' NemotronH never ties: the hub always holds lm_head.weight
            tie_embeddings=False,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            init_std=hf.get("initializer_range", 0.02),
        )

    def from_hf_checkpoint(self, hf: dict[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        cfg = self.from_hf_config(hf)
        if cfg.mtp is not None and not any(name.startswith("mtp.") for name in tensor_names):
            cfg.mtp = None  # saved by transformers, which drops the MTP layers
        return cfg

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        att = cfg.attention
        if att.type != "gqa" or att.rope.type != "none" or att.qkv_bias or att.out_bias or att.qk_norm:
            raise ValueError(f"{self.name}: attention must be GQA without rope, biases or qk-norm ({ARCH} has none)")
        hf: dict[str, Any] = {
            "architectures": [ARCH],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "layers_block_type": [HUB_LAYER_TYPES[s] for s in cfg.pattern],
            "num_attention_heads": att.num_heads,
            "num_key_value_heads": att.num_kv_heads,
            "head_dim": att.head_dim,
            "attention_bias": False,
            "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": False,
            "max_position_embeddings": cfg.max_position_embeddings,
            "initializer_range": cfg.init_std,
            "mlp_hidden_act": "relu2",
            "mamba_hidden_act": "silu",
            "num_nextn_predict_layers": cfg.mtp.stored_layers if cfg.mtp else 0,
        }
        if cfg.mtp:
            hf["mtp_layers_block_type"] = [HUB_LAYER_TYPES[s] for s in cfg.mtp.pattern]
        biases = set()
        if cfg.mlp is not None:
            hf.update(intermediate_size=cfg.mlp.intermediate_size)
            biases.add(cfg.mlp.bias)
        if cfg.mamba is not None:
            hf.update(mamba_to_hf(cfg.mamba, cfg.norm_eps))
        if cfg.moe is not None:
            hf.update(moe_to_hf(cfg.moe))
            biases.add(cfg.moe.shared_latent_bias)
        if len(biases) > 1:
            raise ValueError(f"{self.name}: mlp.bias and moe.shared_latent_bias must agree ({ARCH} has one mlp_bias)")
        hf["mlp_bias"] = biases.pop() if biases else False
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        maps = [TensorMap.rename("norm.weight", "backbone.norm_f.weight")]
        if cfg.tie_embeddings:
            # a tied native model exports the embedding twice, since transformers' NemotronH never ties
            maps.append(TensorMap("embed.weight", ("backbone.embeddings.weight", "lm_head.weight"),
                                  to_hf=lambda tensor: [tensor, tensor.clone()]))
        else:
            maps += [TensorMap.rename("embed.weight", "backbone.embeddings.weight"),
                     TensorMap.rename("lm_head.weight", "lm_head.weight")]
        for i, symbol in enumerate(cfg.pattern):
            maps += layer_maps(cfg, symbol, f"layers.{i}", f"backbone.layers.{i}")
        return maps + mtp_maps(cfg)


def mamba_to_hf(mamba: MambaConfig, norm_eps: float) -> dict[str, Any]:
    if mamba.time_step_limit != (mamba.time_step_min, float("inf")):
        raise ValueError(
            f"mamba.time_step_limit={mamba.time_step_limit}: {ARCH} clamps dt to (time_step_min, inf) = "
            f"({mamba.time_step_min}, inf)"
        )
    if mamba.norm_eps != norm_eps:
        raise ValueError(f"mamba.norm_eps={mamba.norm_eps} != norm_eps={norm_eps} ({ARCH} has one layer_norm_epsilon)")
    if mamba.num_heads * mamba.head_dim % mamba.n_groups:
        raise ValueError(f"mamba: num_heads * head_dim must be a multiple of n_groups={mamba.n_groups}")
    return {
        "mamba_num_heads": mamba.num_heads,
        "mamba_head_dim": mamba.head_dim,
        "ssm_state_size": mamba.state_size,
        "n_groups": mamba.n_groups,
        "conv_kernel": mamba.conv_kernel,
        "chunk_size": mamba.chunk_size,
        "use_conv_bias": mamba.conv_bias,
        "use_bias": mamba.proj_bias,
        "time_step_min": mamba.time_step_min,
        "time_step_max": mamba.time_step_max,
        "time_step_floor": mamba.time_step_floor,
    }


def moe_to_hf(moe: MoEConfig) -> dict[str, Any]:
    hub_like = (moe.activation == "relu2" and moe.score_func == "sigmoid" and moe.score_correction_bias
                and moe.num_shared_experts == 1 and not moe.expert_bias and not moe.router_bias)
    if not hub_like:
        raise ValueError(
            f"moe: {ARCH} has squared-ReLU experts without biases, a sigmoid router with expert bias and no "
            "router bias, and one shared expert"
        )
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate_size,
        "moe_shared_expert_intermediate_size": moe.shared_size,
        "n_shared_experts": 1,
        "moe_latent_size": moe.latent_size,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
    }


def linear_maps(native: str, hub: str, names: Sequence[str], bias: bool) -> list[TensorMap]:
    kinds = ("weight", "bias") if bias else ("weight",)
    return [TensorMap.rename(f"{native}.{n}.{k}", f"{hub}.{n}.{k}") for n in names for k in kinds]


def layer_maps(cfg: ModelConfig, symbol: str, native: str, hub: str) -> list[TensorMap]:
    """One block: native prefix (``layers.3``, ``mtp.depths.0.layers.1``) <-> hub layer prefix."""
    maps = [TensorMap.rename(f"{native}.norm.weight", f"{hub}.norm.weight")]
    mixer = f"{hub}.mixer"
    if symbol == "M":
        mamba = cfg.mamba
        maps += linear_maps(f"{native}.mamba", mixer, ("in_proj", "out_proj"), mamba.proj_bias)
        maps += linear_maps(f"{native}.mamba", mixer, ("conv1d",), mamba.conv_bias)
        maps += [TensorMap.rename(f"{native}.mamba.{n}", f"{mixer}.{n}") for n in ("dt_bias", "A_log", "D", "norm.weight")]
    elif symbol == "*":
        maps += linear_maps(f"{native}.attn", mixer, ("q_proj", "k_proj", "v_proj", "o_proj"), False)
    elif symbol == "-":
        maps += linear_maps(f"{native}.mlp", mixer, ("up_proj", "down_proj"), cfg.mlp.bias)
    else:
        moe, native_moe = cfg.moe, f"{native}.moe"
        maps += [
            TensorMap.rename(f"{native_moe}.router.weight", f"{mixer}.gate.weight"),
            TensorMap.rename(f"{native_moe}.router.score_correction_bias", f"{mixer}.gate.e_score_correction_bias"),
        ]
        for proj in ("up_proj", "down_proj"):
            per_expert = [f"{mixer}.experts.{e}.{proj}.weight" for e in range(moe.num_experts)]
            maps.append(TensorMap.stacked(f"{native_moe}.experts.{proj}", per_expert))
        maps += linear_maps(f"{native_moe}.shared_experts", f"{mixer}.shared_experts", ("up_proj", "down_proj"),
                            moe.shared_latent_bias)
        if moe.latent_size:
            maps += linear_maps(native_moe, mixer, ("fc1_latent_proj", "fc2_latent_proj"), moe.shared_latent_bias)
    return maps


def mtp_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Depth ``d``, inner layer ``j`` <-> hub ``mtp.layers.{d*L + j}``; the depth's own tensors sit on its
    first (``eh_proj``, ``enorm``, ``hnorm``) and last (``final_layernorm``) inner layer. A shared MTP layer
    (``mtp.shared``) is the hub's one depth, whatever the number of depths that apply it."""
    if cfg.mtp is None:
        return []
    inner = cfg.mtp.pattern
    maps = []
    for d in range(cfg.mtp.stored_layers):
        native = f"mtp.depths.{d}"
        first, last = f"mtp.layers.{d * len(inner)}", f"mtp.layers.{(d + 1) * len(inner) - 1}"
        maps += [TensorMap.rename(f"{native}.{n}.weight", f"{first}.{n}.weight") for n in ("eh_proj", "enorm", "hnorm")]
        maps.append(TensorMap.rename(f"{native}.final_norm.weight", f"{last}.final_layernorm.weight"))
        for j, symbol in enumerate(inner):
            maps += layer_maps(cfg, symbol, f"{native}.layers.{j}", f"mtp.layers.{d * len(inner) + j}")
    return maps


FAMILY = NemotronH(name="nemotron_h", architectures=(ARCH,), model_type="nemotron_h")
