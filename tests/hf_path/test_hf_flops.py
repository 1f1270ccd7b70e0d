"""Model FLOPs of transformers models on the generic path against FlopCounterMode on a real forward + backward
(eager experts and attention, whose matmuls FlopCounterMode sees): the fake-tensor count for architectures the
package counts that way, the native family's ModelConfig for ones that map to a family."""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import VOCAB, kimi_linear_config, qwen3_next_config
from torch.utils.flop_counter import FlopCounterMode

from lightning_moe.models.flops import batch_flops
from lightning_moe.models.hf_flops import CountedFlops, native_model_config


def real_step_flops(config, lengths: list[int], rows: int = 1) -> float:
    """FlopCounterMode over a real forward + backward, one sequence of each length alone (``rows`` rows)."""
    import transformers as t

    config = config.__class__.from_dict(config.to_dict())
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"  # sdpa's CPU kernel has no FlopCounterMode formula
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total = 0.0
    for length in lengths:
        ids = torch.randint(3, VOCAB, (rows, length))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        total += counter.get_total_flops()
    return total


def packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("make_config", [qwen3_next_config, kimi_linear_config], ids=["qwen3_next", "kimi_linear"])
def test_fake_tensor_count_matches_a_real_step(make_config):
    import transformers as t

    config = make_config()
    model_class = t.AutoModelForCausalLM._model_mapping[type(config)]
    counted = CountedFlops(model_class, config)
    # rows of 64: fitted at 64 and 32; a packed row of 40 + 24 falls between
    plain = counted.batch_flops(torch.arange(64).expand(2, 64))
    assert plain == pytest.approx(real_step_flops(config, [64], rows=2), rel=0.05)
    packed = counted.batch_flops(packed_positions([40, 24]))
    assert packed == pytest.approx(real_step_flops(config, [40, 24]), rel=0.05)
    # frozen weights: input gradients only in the backward
    assert counted.batch_flops(torch.arange(64)[None], trainable_fraction=0.0) < counted.batch_flops(
        torch.arange(64)[None])


def test_architectures_with_a_native_family_count_its_model_config():
    import transformers as t

    config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    model_config = native_model_config(config)
    assert model_config is not None and model_config.hidden_size == 64
    # FlopCounterMode counts eager attention's full score square, the native count the causal half: short
    # sequences, where the scores are a small share, keep the two within 5%
    lengths = [10, 6]
    positions = packed_positions(lengths)
    native = batch_flops(model_config, positions, torch.ones_like(positions))
    assert native == pytest.approx(real_step_flops(config, lengths), rel=0.05)


def test_architectures_without_a_native_family_are_counted():
    import transformers as t

    config = t.OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                           architectures=["OlmoeForCausalLM"])
    assert native_model_config(config) is None
    counted = CountedFlops(t.OlmoeForCausalLM, config)
    assert counted.batch_flops(torch.arange(32).expand(2, 32)) == pytest.approx(
        real_step_flops(config, [32], rows=2), rel=0.05)


def test_throughput_counts_a_generic_path_run_by_its_fake_step(tmp_path):
    """A Trainer run of OLMoE (no native family) through CausalLM: Throughput's FLOPs are the counted ones of
    the very micro-batches, and the run card names the method."""
    import lightning as L
    import transformers as t
    from tiny_hf_models import save_tiny

    from lightning_moe.callbacks import Throughput
    from lightning_moe.data import MockDataModule
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.models.hf_flops import COUNTED_METHOD
    from lightning_moe.modules.causal_lm import CausalLM
    from lightning_moe.modules.optim import OptimizerConfig

    config = t.OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    model_dir = save_tiny(config, tmp_path / "olmoe")
    throughput = Throughput()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[throughput], default_root_dir=tmp_path)
    data = MockDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=VOCAB,
                          num_val_samples=0)
    trainer.fit(CausalLM(model=HFModelConfig(hf=str(model_dir)), optimizer=OptimizerConfig(lr=1e-3)), datamodule=data)
    assert throughput.summary()["flops_method"] == COUNTED_METHOD
    expected = 2 * CountedFlops(t.OlmoeForCausalLM, config).batch_flops(torch.arange(16).expand(2, 16))
    assert throughput.history.values()[0].flops == pytest.approx(expected)
