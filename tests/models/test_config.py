"""ModelConfig: a bad config fails at construction with a message naming the key; configs round-trip as JSON."""

from __future__ import annotations

import pytest

from lightning_moe.models.config import (
    AttentionConfig,
    LinearAttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
)


def _moe(**kwargs) -> MoEConfig:
    return MoEConfig(**{"num_experts": 8, "top_k": 2, **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    ({"pattern": "*X"}, r"ModelConfig.pattern '\*X': unknown symbols \['X'\]"),
    ({"pattern": "*E", "mlp": None}, r"ModelConfig.pattern contains 'E' but ModelConfig.moe is not set"),
    ({"pattern": "*-", "mtp": MTPConfig(num_layers=1, pattern="*E")},
     r"ModelConfig.mtp.pattern contains 'E' but ModelConfig.moe is not set"),
    ({"pattern": "*-", "mtp": MTPConfig(num_layers=1, pattern="*Q")}, r"ModelConfig.mtp.pattern '\*Q': unknown"),
    ({"attention": AttentionConfig(num_heads=6, num_kv_heads=4)}, "num_heads=6 is not a multiple of num_kv_heads=4"),
    ({"attention": AttentionConfig(sliding_window=4, sliding_window_layers=[True])},
     "sliding_window_layers has 1 entries, the pattern has 2 attention blocks"),
    ({"pattern": "*E", "moe": _moe(top_k=9)}, r"moe.top_k=9 > num_experts=8"),
    ({"pattern": "*E", "moe": _moe(n_group=3)}, "num_experts=8 not divisible by n_group=3"),
    ({"pattern": "*E", "moe": _moe(n_group=8, topk_group=2)}, ">= 2 experts per group"),
    ({"pattern": "*E", "moe": _moe(n_group=4, topk_group=5)}, "1 <= topk_group <= n_group"),
    ({"pattern": "*E", "moe": _moe(n_group=4, topk_group=1, top_k=3)}, "top_k <= topk_group \\* experts per group"),
    ({"pattern": "M-", "mamba": MambaConfig(num_heads=6, n_groups=4)}, "num_heads=6 is not a multiple of n_groups=4"),
    ({"pattern": "G-", "linear_attention": LinearAttentionConfig(num_k_heads=4, num_v_heads=6)},
     "num_v_heads=6 is not a multiple of num_k_heads=4"),
    ({"pattern": "K-", "linear_attention": LinearAttentionConfig(num_k_heads=4, num_v_heads=8)},
     r"KDA \('K'\) needs num_k_heads == num_v_heads"),
    ({"pattern": "K-", "linear_attention": LinearAttentionConfig(num_k_heads=4, num_v_heads=4, chunk_size=24)},
     "chunk_size=24: KDA needs a multiple of 16"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_group_limited_routing_within_limits_is_accepted():
    ModelConfig(pattern="*E", moe=_moe(n_group=4, topk_group=2, top_k=4))


def test_json_round_trip_and_unknown_keys(tmp_path):
    config = ModelConfig(pattern="M*E", mlp=MLPConfig(intermediate_size=64), moe=_moe(), mamba=MambaConfig(),
                         mtp=MTPConfig(num_layers=1, pattern="*E"))
    config.save(tmp_path / "model_config.json")
    assert ModelConfig.load(tmp_path / "model_config.json") == config
    data = config.to_dict()
    data["moe"]["num_expert"] = 4
    with pytest.raises(ValueError, match=r"ModelConfig.moe: unknown keys \['num_expert'\]"):
        ModelConfig.from_dict(data)
