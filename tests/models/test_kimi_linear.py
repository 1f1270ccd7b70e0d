"""Kimi-Linear: config translation (transformers' and the hub's config.json spellings), hub-layout round trip
(three KDA convs joined and split, A_log reshaped), logits against transformers (plain, and packed rows against
the sequences alone) and the gradients of a training step."""

from __future__ import annotations

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
    from transformers import KimiLinearConfig

    kwargs = dict(
        architectures=["KimiLinearForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, layer_types=LAYER_TYPES, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, linear_head_dim=16,
        linear_num_heads=4, n_group=2, topk_group=1, routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def build_tiny(seed: int = 0):
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(hf_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)
            else:
                param.normal_(1.0 if "norm" in name.rsplit(".", 2)[-2] else 0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model.eval()


def to_hub_layout(directory):
    """transformers writes dense layers under ``block_sparse_moe``; the hub's checkpoints name them ``mlp``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if ".block_sparse_moe." in name and ".experts." not in name and ".gate." not in name \
                and ".shared_experts." not in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
        renamed[name] = t
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    model = build_tiny()
    model.save_pretrained(path)
    to_hub_layout(path)
    return model, path


def test_rotary_mla_is_refused_by_name():
    hf = hf_config().to_dict()
    family_by_name("kimi_linear").from_hf_config(dict(hf, mla_use_nope=True))
    with pytest.raises(ValueError, match="mla_use_nope"):
        family_by_name("kimi_linear").from_hf_config(dict(hf, mla_use_nope=False))


def test_config_reads_layer_types_and_settings():
    hf = hf_config().to_dict()
    cfg = family_for_hf_config(hf).from_hf_config(hf)
    assert cfg.pattern == "K-KE*EKE"
    la = cfg.linear_attention
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.conv_kernel) == (4, 4, 16, 4)
    assert cfg.attention.type == "mla" and cfg.attention.rope.type == "none"
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.num_shared_experts, moe.score_func) == (8, 2, 2, 1, "sigmoid")
    assert moe.routed_scaling_factor == 2.0 and moe.score_correction_bias


def test_hub_config_spelling_gives_the_same_model():
    """The hub's config.json: 1-indexed layer lists in linear_attn_config, its own MoE key names."""
    family = family_by_name("kimi_linear")
    want = family.from_hf_config(hf_config().to_dict())
    hub = {k: v for k, v in hf_config().to_dict().items() if k not in ("layer_types", "mlp_layer_types",
                                                                        "linear_num_heads", "linear_head_dim")}
    hub["linear_attn_config"] = {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4, "head_dim": 16,
                                 "short_conv_kernel_size": 4}
    hub["first_k_dense_replace"] = 1
    assert family.from_hf_config(hub) == want


def test_to_hf_config_loads_in_transformers_and_translates_back():
    from transformers import KimiLinearConfig

    family = family_by_name("kimi_linear")
    cfg = family.from_hf_config(hf_config().to_dict())
    exported = family.to_hf_config(cfg)
    reloaded = KimiLinearConfig(**{k: v for k, v in exported.items() if k != "architectures"})
    assert reloaded.layer_types == LAYER_TYPES
    assert family.from_hf_config(reloaded.to_dict()) == cfg


def test_round_trip_is_bitwise(tmp_path, checkpoint):
    import transformers

    _, hub = checkpoint
    native = import_hf_checkpoint(hub, tmp_path / "native")
    assert "layers.0.kda.conv1d.weight" in SafetensorsDir(native).keys()
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(hub, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hub).keys())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, checkpoint[0](ids).logits)


def test_logits_equal_transformers(checkpoint):
    hf, path = checkpoint
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    assert_logits_match(load_pretrained(path), hf, ids)


def test_packed_row_equals_sequences_alone(checkpoint):
    hf, path = checkpoint
    lengths = [5, 70, 1, 20]
    gen = torch.Generator().manual_seed(2)
    assert_packed_logits_match(load_pretrained(path), hf, [torch.randint(0, 128, (n,), generator=gen) for n in lengths])


def test_training_step_gradients_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    assert_step_gradients_match(load_pretrained(path), hf, ids, {
        "layers.0.kda.A_log": "model.layers.0.self_attn.forget_gate.A_log",
        "layers.0.kda.dt_bias": "model.layers.0.self_attn.forget_gate.dt_bias",
        "layers.0.kda.f_b_proj.weight": "model.layers.0.self_attn.forget_gate.f_b_proj.weight",
        "layers.0.kda.g_a_proj.weight": "model.layers.0.self_attn.g_a_proj.weight",
        "layers.0.kda.conv1d.weight": "model.layers.0.self_attn.conv1d.weight",
        "layers.4.attn.kv_b_proj.weight": "model.layers.2.self_attn.kv_b_proj.weight",
    })


def test_transformers_saved_checkpoint_round_trips_bitwise(tmp_path):
    """transformers writes dense layers under ``block_sparse_moe``: they import, and export the same way."""
    build_tiny(seed=1).save_pretrained(tmp_path / "hf")
    native = import_hf_checkpoint(tmp_path / "hf", tmp_path / "native")
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(tmp_path / "hf", tmp_path / "export")
    assert report.ok, report.summary()
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in SafetensorsDir(tmp_path / "export").keys()
