"""GLM-4.5 (GQA with partial rotary and qk-norm, DeepSeek-style MoE): logits equal transformers', bitwise round trip."""

from __future__ import annotations

import pytest
import torch
from tiny_moe_hf import (
    TOL,
    add_mtp_layer,
    build_tiny,
    check_bitwise_round_trip,
    max_logit_diff,
    max_packed_diff,
    round_trip,
    save_tiny,
)

from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name
from lightning_moe.models.layers.rope import RotaryEmbedding

# config.json of zai-org/GLM-4.5-Air (the keys that shape the model)
HUB_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "first_k_dense_replace": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
    "topk_group": 1, "use_qk_norm": False, "vocab_size": 151552,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe")
    hf = build_tiny("glm4_moe")
    hf.save_pretrained(path)
    return hf, load_pretrained(path)


def test_logits_equal_transformers(models):
    hf, native = models
    assert native.config.attention.qk_norm and native.config.attention.rope.partial_rotary_factor == 0.5
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(hf, native, ids) <= TOL
    assert max_packed_diff(hf, native, [7, 12, 5]) <= TOL


def test_translation_of_the_hub_config():
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    cfg = family_by_name("glm4_moe").from_hf_config(HUB_CONFIG)
    assert cfg.pattern == "*-" + "*E" * 45 and cfg.mtp.num_layers == 1
    att, moe = cfg.attention, cfg.moe
    assert (att.qkv_bias, att.out_bias, att.qk_norm, att.head_dim) == (True, False, False, 128)
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.score_func) == (128, 8, 1, "sigmoid")
    theirs = Glm4MoeRotaryEmbedding(transformers.Glm4MoeConfig(**HUB_CONFIG))
    ours = RotaryEmbedding(att.rope, att.head_dim, cfg.max_position_embeddings)
    assert ours.dim == 64
    assert torch.allclose(ours.inv_freq(torch.device("cpu")), theirs.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_export_is_bitwise(tmp_path, dtype):
    check_bitwise_round_trip("glm4_moe", tmp_path, dtype)


@pytest.mark.parametrize("weight_copies", [True, False], ids=["glm4.5", "glm4.6-no-copies"])
def test_mtp_layer_round_trip_is_bitwise(tmp_path, weight_copies):
    hf_dir = save_tiny("glm4_moe", tmp_path / "hf")
    add_mtp_layer(hf_dir, "glm4_moe", weight_copies=weight_copies)
    report = round_trip(hf_dir, tmp_path)
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hf_dir).keys())
    native = load_pretrained(tmp_path / "native")
    ids = torch.randint(0, 96, (1, 12))
    out = native(ids, labels=torch.roll(ids, -1, 1))
    assert len(out.mtp_loss_sums) == 1 and torch.isfinite(out.mtp_loss_sums[0])
