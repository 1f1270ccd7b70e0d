"""Freezing by pattern for full fine-tuning."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.peft import LoraConfig, apply_lora, freeze_parameters


def tiny() -> Decoder:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-*-",
                      attention=AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=16),
                      mlp=MLPConfig(intermediate_size=48))
    with torch.device("meta"):
        return Decoder(cfg)


def test_patterns_freeze_whole_names_only():
    model = tiny()
    frozen = freeze_parameters(model, [r"embed\..*", r"layers\.[01]\..*"])
    assert "embed.weight" in frozen and "layers.1.mlp.up_proj.weight" in frozen
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(n.startswith(("layers.2.", "layers.3.", "norm.", "lm_head.")) for n in trainable)


def test_patterns_see_plain_names_under_adapters():
    model = tiny()
    apply_lora(model, LoraConfig(target_modules=["q_proj"]))
    for param in model.parameters():
        param.requires_grad_(True)
    assert freeze_parameters(model, [r".*\.q_proj\.weight"]) == ["layers.0.attn.q_proj.weight",
                                                               "layers.2.attn.q_proj.weight"]
    assert not model.get_parameter("layers.0.attn.q_proj.base_layer.weight").requires_grad


def test_bad_patterns_are_named():
    with pytest.raises(ValueError, match=r"freeze pattern 'embed' matches no parameter \(it must match a whole name"):
        freeze_parameters(tiny(), ["embed"])
    with pytest.raises(ValueError, match=r"freeze pattern 'layers\.\[' is not a valid regular expression"):
        freeze_parameters(tiny(), ["layers.["])
