"""Qwen3-Next: config translation, round trip (fused qkvz/ba rows permuted both ways), logits against
transformers (plain, and packed rows against the sequences alone, since transformers' mixer leaks state across
a packed boundary), and gradients of a training step."""

from __future__ import annotations

import json

import pytest
import torch
from transformers_reference import (
    assert_logits_match,
    assert_packed_logits_match,
    assert_step_gradients_match,
)

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name, family_for_hf_config

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def hf_config(**overrides):
    from transformers import Qwen3NextConfig

    kwargs = dict(
        architectures=["Qwen3NextForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return Qwen3NextConfig(**kwargs)


def randomize(model, seed: int = 0):
    """Norm weights around 0 (the norms scale by 1 + weight), the rest around 0 with std 0.1: nothing degenerate."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)
            else:
                param.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1)
    return model.eval()


def build_tiny(seed: int = 0, **overrides):
    from transformers import Qwen3NextForCausalLM

    return randomize(Qwen3NextForCausalLM(hf_config(**overrides)), seed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    model = build_tiny()
    model.save_pretrained(path)
    return model, path


def test_config_reads_layer_types_and_settings():
    hf = hf_config().to_dict()
    cfg = family_for_hf_config(hf).from_hf_config(hf)
    assert cfg.pattern == "GEG-*EGE"
    la = cfg.linear_attention
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == (2, 4, 8, 12, 4)
    att = cfg.attention
    assert att.qk_norm and att.output_gate and att.rope.partial_rotary_factor == 0.25
    assert cfg.norm_offset and cfg.moe.shared_expert_gate and cfg.moe.shared_size == 48
    assert cfg.moe.score_func == "softmax" and cfg.moe.norm_topk_prob


def test_to_hf_config_loads_in_transformers_and_translates_back():
    from transformers import Qwen3NextConfig

    family = family_by_name("qwen3_next")
    cfg = family.from_hf_config(hf_config().to_dict())
    exported = family.to_hf_config(cfg)
    reloaded = Qwen3NextConfig(**{k: v for k, v in exported.items() if k != "architectures"})
    assert reloaded.layer_types == LAYER_TYPES and reloaded.mlp_only_layers == [1]
    assert family.from_hf_config(reloaded.to_dict()) == cfg


def test_config_errors_name_the_key():
    hf = {**hf_config().to_dict(), "layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]}
    with pytest.raises(ValueError, match=r"layer_types must list 4 of .* unknown \['mamba'\]"):
        family_by_name("qwen3_next").from_hf_config(hf)


def test_round_trip_is_bitwise(tmp_path, checkpoint):
    """transformers' checkpoint (no mtp.* tensors: no MTP depth); the hub's MTP layer: test_qwen3_next_mtp.py."""
    _, hub = checkpoint
    native = import_hf_checkpoint(hub, tmp_path / "native")
    names = SafetensorsDir(native).keys()
    assert "layers.0.gdn.in_proj_qkv.weight" in names and "layers.0.gdn.in_proj_a.weight" in names
    assert not any(name.startswith("mtp.") for name in names)
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(hub, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hub).keys())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["layer_types"] == LAYER_TYPES


def test_logits_equal_transformers(checkpoint):
    hf, path = checkpoint
    # 70 tokens: two chunks of 64 with a partial second one
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    assert_logits_match(load_pretrained(path), hf, ids)


def test_packed_row_equals_sequences_alone(checkpoint):
    hf, path = checkpoint
    lengths = [5, 70, 1, 20]  # a sequence across the chunk boundary (64), a 1-token one
    gen = torch.Generator().manual_seed(2)
    assert_packed_logits_match(load_pretrained(path), hf, [torch.randint(0, 128, (n,), generator=gen) for n in lengths])


def test_training_step_gradients_match_transformers(checkpoint):
    """Loss and the gradients of the mixer and MoE weights equal transformers' on the same batch."""
    hf, path = checkpoint
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    assert_step_gradients_match(load_pretrained(path), hf, ids, {
        "layers.0.gdn.A_log": "model.layers.0.linear_attn.A_log",
        "layers.0.gdn.dt_bias": "model.layers.0.linear_attn.dt_bias",
        "layers.0.gdn.conv1d.weight": "model.layers.0.linear_attn.conv1d.weight",
        "layers.0.gdn.out_proj.weight": "model.layers.0.linear_attn.out_proj.weight",
        "layers.4.attn.q_proj.weight": "model.layers.2.self_attn.q_proj.weight",
        "layers.1.moe.shared_expert_gate.weight": "model.layers.0.mlp.shared_expert_gate.weight",
    })
