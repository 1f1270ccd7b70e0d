"""GPT-OSS (sinks, alternating sliding windows, biased clamped-SwiGLU experts, yarn): logits equal
transformers', the fused interleaved expert layout round-trips bitwise."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_moe_hf import TOL, build_tiny, check_bitwise_round_trip, max_logit_diff, max_packed_diff

from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.models.families import family_by_name
from lightning_moe.models.layers.rope import RotaryEmbedding

# config.json of openai/gpt-oss-20b (the keys that shape the model)
HUB_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = build_tiny("gpt_oss")
    hf.save_pretrained(path)
    return hf, load_pretrained(path)


def test_logits_equal_transformers(models):
    hf, native = models
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(hf, native, ids) <= TOL
    assert max_packed_diff(hf, native, [7, 12, 5]) <= TOL


def test_sliding_window_and_sinks_take_part(models):
    """The window (5 tokens) and the sinks change the logits of a 24-token row, so the checks above see them."""
    hf, native = models
    ids = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    assert native.config.attention.sliding_window_layers == [True, False]
    attentions = [block.attn for block in native.layers.values() if block.symbol == "*"]
    assert attentions[0].window == 5 and attentions[1].window is None
    with torch.no_grad():
        reference = native(ids)
        attentions[0].window = None
        without_window = native(ids)
        attentions[0].window = 5
        sinks = [a.sinks.clone() for a in attentions]
        for a in attentions:
            a.sinks.fill_(-1e4)
        without_sinks = native(ids)
        for a, saved in zip(attentions, sinks):
            a.sinks.copy_(saved)
    assert (reference - without_window).abs().max() > 1e-3
    assert (reference - without_sinks).abs().max() > 1e-3


def test_packed_rows_with_flex_attention(models, monkeypatch):
    """Sinks with flex attention (the log-sum-exp correction). Compiled flex_attention on CPU cannot return
    the log-sum-exp, so this runs torch's eager flex_attention, the reference the compiled kernels match."""
    from torch.nn.attention.flex_attention import flex_attention

    import lightning_moe.kernels.flex as flex_kernels

    monkeypatch.setattr(flex_kernels, "_compiled", flex_attention)
    hf, native = models
    monkeypatch.setattr(native.config.attention, "backend", "flex")  # shared by the attention blocks
    assert max_packed_diff(hf, native, [9, 6, 9]) <= TOL


def test_translation_of_the_hub_config():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = family_by_name("gpt_oss").from_hf_config(HUB_CONFIG)
    att, moe = cfg.attention, cfg.moe
    assert cfg.pattern == "*E" * 24 and att.sinks and att.qkv_bias and att.out_bias
    assert att.sliding_window == 128 and att.sliding_window_layers == [True, False] * 12
    assert moe.activation == "swiglu_clamped" and moe.expert_bias and moe.router_bias and moe.norm_topk_prob
    hf_config = transformers.GptOssConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "quantization_config"})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours = RotaryEmbedding(att.rope, att.head_dim, cfg.max_position_embeddings)
    assert torch.allclose(ours.inv_freq(torch.device("cpu")), inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(ours.attention_scaling, scaling, rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_export_is_bitwise(tmp_path, dtype):
    check_bitwise_round_trip("gpt_oss", tmp_path, dtype)


def test_expert_layout_is_deinterleaved(models):
    """Expert e's gate rows are the even columns of transformers' fused ``gate_up_proj[e]``, up the odd ones."""
    hf, native = models
    fused = hf.model.layers[1].mlp.experts
    ours = native.layers["3"].moe.experts
    assert torch.equal(ours.gate_proj, fused.gate_up_proj[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.up_proj, fused.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(ours.up_bias, fused.gate_up_proj_bias[:, 1::2])
    assert torch.equal(ours.down_proj, fused.down_proj.transpose(1, 2))
