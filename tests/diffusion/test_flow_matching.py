"""Timestep shifts equal diffusers' scheduler's, draws are per sample and reproducible, and the FLOP count of the
Qwen-Image transformer matches torch's FLOP counter."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_qwen_image import SCHEDULER

from lightning_moe.models.diffusion import FlowMatchingConfig
from lightning_moe.models.diffusion.flow_matching import (
    draw_sample,
    noisy_latents,
    sample_generator,
    shifted_sigmas,
)


def test_shifts_are_the_schedulers():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    u = torch.linspace(0.01, 0.99, 17)
    cfg = FlowMatchingConfig()
    dynamic = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    mu = calculate_shift(4096, SCHEDULER["base_image_seq_len"], SCHEDULER["max_image_seq_len"],
                         SCHEDULER["base_shift"], SCHEDULER["max_shift"])
    torch.testing.assert_close(shifted_sigmas(u, cfg, SCHEDULER, 4096), dynamic.time_shift(mu, 1.0, u))
    linear = {**SCHEDULER, "time_shift_type": "linear"}
    torch.testing.assert_close(shifted_sigmas(u, cfg, linear, 4096),
                               FlowMatchEulerDiscreteScheduler(**linear).time_shift(mu, 1.0, u))
    # a static shift (SD3's shift=3): the scheduler's own training sigmas, from its unshifted t / 1000
    static = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    unshifted = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(shifted_sigmas(unshifted, cfg, dict(static.config), 4096), static.sigmas)
    assert torch.equal(shifted_sigmas(u, FlowMatchingConfig(shift=1.0), SCHEDULER, 4096), u)


def test_draws_are_per_sample_and_reproducible():
    cfg = FlowMatchingConfig(condition_dropout=0.5)
    a = draw_sample(sample_generator(0, 3, 11), cfg, SCHEDULER, (4, 4, 4), 4)
    b = draw_sample(sample_generator(0, 3, 11), cfg, SCHEDULER, (4, 4, 4), 4)
    c = draw_sample(sample_generator(0, 3, 12), cfg, SCHEDULER, (4, 4, 4), 4)
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    assert not torch.equal(a[0], c[0]) and a[1] != c[1]
    drops = [draw_sample(sample_generator(0, 0, i), cfg, SCHEDULER, (1,), 4)[2] for i in range(400)]
    assert 0.4 < sum(drops) / len(drops) < 0.6
    # logit-normal: sigmas cluster around the shifted median, never 0 or 1
    sigmas = torch.stack([draw_sample(sample_generator(1, 0, i), FlowMatchingConfig(shift=1.0), SCHEDULER, (1,), 4)[1]
                          for i in range(2000)])
    assert 0 < sigmas.min() and sigmas.max() < 1 and abs(sigmas.median().item() - 0.5) < 0.05
    latents, noise, s = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2), torch.tensor([0.0, 1.0])
    noisy, target = noisy_latents(latents, noise, s)
    assert torch.equal(noisy[0], latents[0]) and torch.equal(noisy[1], noise[1])
    assert torch.equal(target, noise - latents)


@pytest.mark.parametrize("text_tokens", [7, 19])
def test_transformer_flops_match_torchs_counter(tiny_pipeline, text_tokens):
    from diffusers import QwenImageTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_moe.models.diffusion.qwen_image import QwenImageFamily

    model = QwenImageTransformer2DModel.from_pretrained(tiny_pipeline / "transformer")
    config, latent_hw = model.config, (6, 8)
    image_tokens = QwenImageFamily.image_tokens(latent_hw)
    packed = torch.randn(2, image_tokens, config.in_channels)
    embeds = torch.randn(2, text_tokens, config.joint_attention_dim)
    mask = torch.ones(2, text_tokens, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        QwenImageFamily.predict(model, packed, torch.tensor([0.2, 0.9]), embeds, mask, latent_hw)
    # torch's counter does not see the CPU attention kernel: the linear layers are compared exactly, and the
    # attention term is two [L, L] x [L, d] products per head and layer
    assert counter.get_total_flops() == 2 * QwenImageFamily.linear_flops(config, image_tokens, text_tokens)
    joint, dim = image_tokens + text_tokens, config.num_attention_heads * config.attention_head_dim
    assert QwenImageFamily.attention_flops(config, image_tokens, text_tokens) == config.num_layers * 4 * joint**2 * dim
    assert math.isclose(QwenImageFamily.flops_per_sample(config, image_tokens, text_tokens),
                        QwenImageFamily.linear_flops(config, image_tokens, text_tokens)
                        + QwenImageFamily.attention_flops(config, image_tokens, text_tokens))
