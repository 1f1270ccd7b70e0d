"""The DeepSeek-V3 layer stack and hub layout, shared by the families that keep it (DeepSeek-V3, GLM-4.5):
``first_k_dense_replace`` dense layers then MoE layers, MTP layers stored after the backbone as
``model.layers.{num_hidden_layers + d}`` with copies of the embedding and output layer. Subclasses of
:class:`DeepseekStyle` choose the attention."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MTPConfig
from lightning_moe.models.families.base import Family, TensorMap, require
from lightning_moe.models.families.common import (
    LayerNames,
    first_k_dense,
    llama_style_model,
    mlp_maps,
    moe_maps,
    prefixed,
    sigmoid_moe_from_hf,
)


def first_k_dense_pattern(hf: dict[str, Any], architecture: str) -> str:
    """``first_k_dense_replace`` (attention, MLP) layers, then (attention, MoE) layers."""
    layers = require(hf, "num_hidden_layers", architecture)
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json ({architecture}): moe_layer_freq={hf['moe_layer_freq']} is not supported (1)")
    dense = min(int(hf.get("first_k_dense_replace") or 0), layers)
    if not hf.get("n_routed_experts"):
        dense = layers
    return "*-" * dense + "*E" * (layers - dense)


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
