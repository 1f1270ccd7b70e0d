"""Native logits equal transformers' on the same weights, for plain and packed rows."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import FAMILIES, build_tiny

from lightning_moe.checkpoint.load import load_pretrained

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (transformers model, native model) sharing weights through a saved checkpoint."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf = build_tiny(family)
        hf.save_pretrained(path)
        out[family] = (hf, load_pretrained(path))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(models, family):
    hf, native = models[family]
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = native(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_packed_row_equals_sequences_alone(models, family, backend):
    hf, native = models[family]
    native.config.attention.backend = backend  # the attention blocks share this config object
    try:
        lengths = [7, 12, 5]
        gen = torch.Generator().manual_seed(2)
        seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in lengths]
        packed = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        with torch.no_grad():
            got = native(packed, position_ids=positions)[0]
            start = 0
            for seq in seqs:
                alone = hf(seq[None]).logits[0]
                assert (got[start : start + len(seq)] - alone).abs().max().item() <= TOL
                start += len(seq)
    finally:
        native.config.attention.backend = "sdpa"


def test_load_pretrained_dtype(tmp_path):
    build_tiny("qwen3").save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 160, (1, 8))
    assert model(ids).dtype == torch.bfloat16


def test_yarn_factor_defaults_to_the_context_ratio_like_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lightning_moe.models.families.common import rope_from_hf
    from lightning_moe.models.layers.rope import inverse_frequencies

    hf = {"max_position_embeddings": 4096, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 1024}}
    rope = rope_from_hf(hf, "LlamaForCausalLM")
    assert rope.factor == 4.0
    # transformers' config validation now insists on a factor: give it the ratio explicitly
    explicit = {**hf, "rope_parameters": {**hf["rope_parameters"], "factor": 4096 / 1024}}
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**explicit))
    got, got_scale = inverse_frequencies(rope, 16, 4096)
    assert torch.allclose(got, expected) and got_scale == pytest.approx(scale)




@pytest.mark.parametrize("kind,extra", [("yarn", {"factor": 4.0}),
                                        ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})])
def test_missing_original_length_defaults_to_max_positions_like_transformers(kind, extra):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lightning_moe.models.families.common import rope_from_hf
    from lightning_moe.models.layers.rope import inverse_frequencies

    hf = {"max_position_embeddings": 2048, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
          "rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **extra}}
    rope = rope_from_hf(hf, "LlamaForCausalLM")
    expected, scale = ROPE_INIT_FUNCTIONS[kind](transformers.LlamaConfig(**hf))
    got, got_scale = inverse_frequencies(rope, 16, 2048)
    assert torch.allclose(got, expected) and got_scale == pytest.approx(scale)

QWEN_SLIDING_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("settings", [
    {},  # transformers' Qwen default: no sliding window, whatever sliding_window says
    {"use_sliding_window": False},
    {"use_sliding_window": True},  # layers from max_window_layers (28) on; Qwen3-MoE: every layer
    {"use_sliding_window": True, "max_window_layers": 1},
    {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
], ids=["unset", "off", "on", "from_layer_1", "layer_types"])
def test_qwen_sliding_windows_are_those_transformers_derives(family, settings):
    import transformers

    from lightning_moe.models.families import family_by_name

    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    theirs = config_class(vocab_size=160, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, sliding_window=8, **settings)
    # a config.json that spells out only ``settings`` of the sliding-window keys
    hf = {k: v for k, v in theirs.to_dict().items() if k not in QWEN_SLIDING_KEYS}
    hf.update(sliding_window=8, **settings)
    ours = family_by_name(family).from_hf_config(hf)
    if family == "qwen3_moe":  # its attention takes config.sliding_window in every layer
        expected = [theirs.sliding_window] * theirs.num_hidden_layers
    else:
        expected = [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
    assert [ours.attention.window_for(i) for i in range(theirs.num_hidden_layers)] == expected
