"""Qwen3.5 text models (``Qwen3_5ForCausalLM`` dense, ``Qwen3_5MoeForCausalLM``): Qwen3-Next's layer stack with
the Gated DeltaNet projections split (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, our own
names). The dense model has an MLP in every layer, the MoE model an MoE with a gated shared expert in every
layer. Their rope is multimodal (mrope) in the vision-language models; for text, whose three position ids are
equal, it is plain partial rope. The vision-language checkpoints (``...ForConditionalGeneration``) stay on the
vision-language path.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.families.base import Family, TensorMap
from lightning_moe.models.families.common import embedding_maps
from lightning_moe.models.families.qwen3_next import (
    check_pattern,
    qwen3_next_hf_config,
    qwen3_next_layer_maps,
    qwen3_next_model,
)

ARCH = "Qwen3_5ForCausalLM"
# keys of Qwen3-Next's config that the Qwen3.5 text configs do not have
NEXT_ONLY = ("decoder_sparse_step", "mlp_only_layers")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")


class Qwen3_5(Family):
    moe: bool = False

    def from_hf_config(self, hf: dict[str, Any]) -> ModelConfig:
        return qwen3_next_model(hf, self.name, self.architectures[0])

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        ffn = set(cfg.pattern[1::2])
        if ffn != {"E" if self.moe else "-"}:
            kind = "an MoE" if self.moe else "a dense MLP"
            raise ValueError(f"{self.name}: every layer has {kind} ({self.architectures[0]}), pattern {cfg.pattern!r}")
        hf = qwen3_next_hf_config(cfg, self.name, self.architectures[0], self.model_type)
        for key in NEXT_ONLY + (() if self.moe else MOE_KEYS):
            hf.pop(key, None)
        return hf

    def weight_map(self, cfg: ModelConfig) -> list[TensorMap]:
        check_pattern(cfg, self.name)
        return embedding_maps(cfg) + qwen3_next_layer_maps(cfg, fused=False)


FAMILY = Qwen3_5(name="qwen3_5", architectures=(ARCH,), model_type="qwen3_5_text")
