"""Tiny random transformers checkpoints of architectures the package has no native family for."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128


def qwen3_next_config(**overrides):
    """Qwen3-Next: gated-delta-net linear attention and gated full attention, alternating, over MoE layers with a
    shared expert (its torch fallbacks run on CPU)."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
        full_attention_interval=2, output_router_logits=True, router_aux_loss_coef=0.01,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return t.Qwen3NextConfig(**{**settings, **overrides})


def kimi_linear_config(**overrides):
    """Kimi-Linear: Kimi delta attention (linear) and MLA layers over a dense layer then MoE layers."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, linear_head_dim=16, linear_num_heads=4, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return t.KimiLinearConfig(**{**settings, **overrides})


def olmoe_config(**overrides):
    """OLMoE: a MoE architecture with no native family (the generic path's own case)."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    return t.OlmoeConfig(**{**settings, **overrides})


def save_tiny(config, path: Path, seed: int = 0, std: float = 0.1) -> Path:
    """A random model of ``config`` written with ``save_pretrained`` (fp32)."""
    import transformers as t

    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    model.save_pretrained(path)
    return path


def batch(rows: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens and pre-shifted labels (a prompt without loss at the start of row 0)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, seq), generator=gen)
    labels = torch.randint(3, VOCAB, (rows, seq), generator=gen)
    labels[0, :5] = -100
    return {"input_ids": input_ids, "labels": labels}


def qwen3_moe_config(**overrides):
    """Qwen3-MoE (which has a native family: tests force the generic path with ``native: never``): transformers'
    standardized experts module under a top-k router."""
    import transformers as t

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return t.Qwen3MoeConfig(**{**settings, **overrides})
