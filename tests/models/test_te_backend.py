"""Transformer Engine backend: chosen without TE installed, a clear error before any training; with TE and a
GPU, packed-row attention equal to SDPA's (the GPU check, benchmarks/gpu_check.py, runs it too)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.layers.attention import attend
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.te import use_te_modules

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def config(attention: AttentionConfig) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", attention=attention, mlp=MLPConfig(64),
                       max_position_embeddings=32)


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is installed here")
@pytest.mark.parametrize("attention", [
    AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, backend="te"),
    AttentionConfig(type="mla", num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                    backend="te"),
], ids=["gqa", "mla"])
def test_te_without_transformer_engine_is_a_clear_error(attention):
    with pytest.raises(ValueError, match=r"attention backend 'te' needs Transformer Engine.*pip install '\.\[te\]'"):
        Decoder(config(attention))


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is installed here")
def test_te_modules_without_transformer_engine_is_a_clear_error():
    model = Decoder(config(AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)))
    message = r"te_modules: true \(Transformer Engine linear / RMSNorm layers\) needs Transformer Engine.*pip install"
    with pytest.raises(ValueError, match=message):
        use_te_modules(model)
    # the config key, as a recipe's model section sets it, on the meta device as the strategy builds models
    cfg = ModelConfig.from_dict({**config(AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)).to_dict(),
                                 "te_modules": True})
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        Decoder(cfg)


@pytest.mark.skipif(not (HAS_TE and torch.cuda.is_available()), reason="needs Transformer Engine and a GPU")
def test_te_attention_on_packed_rows_equals_sdpa():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    layout = SequenceLayout(torch.cat([torch.arange(7), torch.arange(12), torch.arange(5)]).expand(2, 24).cuda())
    got = attend(q, k, v, layout, backend="te", scale=0.125)
    expected = attend(q, k, v, layout, backend="sdpa", scale=0.125)
    assert (got.float() - expected.float()).abs().max() < 2e-2


@pytest.mark.skipif(not (HAS_TE and torch.cuda.is_available()), reason="needs Transformer Engine and a GPU")
def test_te_modules_key_built_on_meta_keeps_the_package_init_and_loss():
    """``te_modules: true`` on the meta device, materialized and initialized as the strategy does: the same
    weights under the same names as the default modules, TE layers in place, and the same loss (bf16)."""
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    models = {}
    for te_modules in (False, True):
        cfg = ModelConfig.from_dict({**config(AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)).to_dict(),
                                     "te_modules": te_modules})
        with torch.device("meta"):
            model = Decoder(cfg)
        model.to_empty(device="cuda")
        model.init_weights(seed=0)
        models[te_modules] = model.to(torch.bfloat16)
    assert "transformer_engine" in type(models[True].layers["0"].attn.q_proj).__module__
    default, te = (dict(m.named_parameters()) for m in (models[False], models[True]))
    assert default.keys() == te.keys()
    for name in default:
        torch.testing.assert_close(te[name], default[name], msg=name)
    losses = [m(ids, labels=ids).loss_sum.float() for m in (models[False], models[True])]
    assert abs(losses[1] - losses[0]) <= 2e-2 * abs(losses[0])
