"""Tiny random configs of the transformers MoE architectures the generic path's expert-parallel tests cover: each
with transformers' standardized experts module over 4 experts (top 2), two or three layers, widths of 64."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_hf_models import VOCAB, kimi_linear_config, qwen3_moe_config, qwen3_next_config

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mimo_v2_flash_config(**overrides):
    """MiMo-V2-Flash: a dense first layer, then MoE layers with a sigmoid router, grouped routing and a
    correction bias; sliding-window and full attention layers with unequal q/k and v head widths."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, sliding_window=8, routed_scaling_factor=1.5,
        layer_types=["full_attention", "sliding_attention", "full_attention"], **IDS,
    )
    return t.MiMoV2FlashConfig(**{**settings, **overrides})


def laguna_config(**overrides):
    """Laguna: a dense first layer, then MoE layers with a sigmoid router whose correction bias is a frozen
    parameter (not a buffer), a shared expert and a routed scaling factor."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, sliding_window=8, moe_routed_scaling_factor=1.5,
        layer_types=["full_attention", "sliding_attention", "full_attention"], **IDS,
    )
    return t.LagunaConfig(**{**settings, **overrides})


def glm_moe_dsa_config(**overrides):
    """GLM-MoE-DSA (GLM-5): MLA with the DeepSeek sparse-attention indexer, a dense first layer, MoE layers with
    grouped sigmoid routing, a correction bias and a shared expert."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
        first_k_dense_replace=1, routed_scaling_factor=1.5, **IDS,
    )
    return t.GlmMoeDsaConfig(**{**settings, **overrides})


def deepseek_v4_config(**overrides):
    """DeepSeek-V4: hyper-connections, compressed/sliding attention, a hash-routed first MoE layer
    (``tid2eid`` lookup) and a learned-router MoE layer with a correction bias, each with a shared expert."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
        sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, num_nextn_predict_layers=0,
        layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
        **IDS,
    )
    return t.DeepseekV4Config(**{**settings, **overrides})


# model_type -> tiny config; qwen3_moe has a native family (tests use native: never)
ARCHITECTURES = {
    "qwen3_moe": qwen3_moe_config, "mimo_v2_flash": mimo_v2_flash_config, "laguna": laguna_config,
    "glm_moe_dsa": glm_moe_dsa_config, "kimi_linear": kimi_linear_config, "qwen3_next": qwen3_next_config,
    "deepseek_v4": deepseek_v4_config,
}


def save_tiny_moe(architecture: str, path: Path, seed: int = 0) -> Path:
    """A random checkpoint of ``ARCHITECTURES[architecture]`` written by transformers. DeepSeek-V4's hash router
    gets a random token -> experts table (two different experts per token; zeros would send every copy to expert
    0), and its final norm is stored under the hub name ``norm.weight``: transformers 5.24 saves it as
    ``model.norm.weight``, which its own loading renames to ``model.kv_norm.weight`` (the ``.norm.`` ->
    ``.kv_norm.`` rule for attention norms) and drops."""
    import transformers as t
    from safetensors.torch import load_file, save_file

    config = ARCHITECTURES[architecture]()
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                first = torch.randint(0, config.n_routed_experts, (buffer.shape[0],))
                second = (first + torch.randint(1, config.n_routed_experts, first.shape)) % config.n_routed_experts
                buffer.copy_(torch.stack([first, second], dim=1))
    model.save_pretrained(path)
    if architecture == "deepseek_v4":
        file = path / "model.safetensors"
        tensors = load_file(file)
        tensors["norm.weight"] = tensors.pop("model.norm.weight")
        save_file(tensors, file, metadata={"format": "pt"})
    return path
