"""Qwen3.5 text models (dense and MoE): config translation, bitwise round trip of transformers' checkpoints,
logits against transformers, plain and packed (against the sequences alone)."""

from __future__ import annotations

import pytest
import torch
from closeness import assert_matches_float64_reference

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_for_hf_config

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def build_tiny(kind: str):
    from test_qwen3_next import randomize
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    if kind == "dense":
        return randomize(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON)))
    return randomize(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **MOE)))


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    model = build_tiny(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_config_and_round_trip(tmp_path, checkpoint):
    kind, hf, path = checkpoint
    config = hf.config.to_dict()
    family = family_for_hf_config(config)
    cfg = family.from_hf_config(config)
    assert cfg.pattern == ("G-*-G-G-" if kind == "dense" else "GE*EGEGE")
    assert family.from_hf_config(family.to_hf_config(cfg)) == cfg
    native = import_hf_checkpoint(path, tmp_path / "native")
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(path, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(path).keys())


def test_logits_plain_and_packed_equal_transformers(checkpoint):
    _, hf, path = checkpoint
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    lengths = [30, 66, 4]
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def native_logits(model):
        return {"plain": model(ids), "packed": model(torch.cat(seqs)[None], position_ids=positions)[0]}

    def transformers_logits(model):
        return {"plain": model(ids).logits, "packed": torch.cat([model(s[None]).logits[0] for s in seqs])}

    with torch.no_grad():
        assert hf(ids).logits.abs().max() > 1.0
        assert_matches_float64_reference(load_pretrained(path), hf, native_logits, transformers_logits,
                                         what="logits")
