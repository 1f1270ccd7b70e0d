"""Rectified-flow (flow-matching) training targets, as diffusers' SD3 / Flux / Qwen-Image training scripts set them.

A clean latent ``x0`` and Gaussian noise ``n`` are mixed at noise level ``sigma`` in [0, 1]:
``x_sigma = (1 - sigma) * x0 + sigma * n``; the transformer, given ``x_sigma`` and ``sigma`` (its timestep input is
``sigma``: the pipelines pass ``t / 1000``), predicts the velocity ``n - x0``. ``sigma`` is drawn from a density
(``logit_normal``, ``mode`` or ``uniform``: diffusers' ``compute_density_for_timestep_sampling``) and then shifted
the way the model's ``FlowMatchEulerDiscreteScheduler`` shifts its inference schedule: by ``mu`` interpolated from
the image's token count (``use_dynamic_shifting``, Qwen-Image's setting) or by the static ``shift``. The squared
error is weighted by ``loss_weighting`` (diffusers' ``compute_loss_weighting_for_sd3``: ``none``, ``sigma_sqrt``,
``cosmap``).

Every sample draws its noise, ``sigma`` and condition dropout from its own generator, seeded by the run seed, the
optimizer step and the row's index in the dataset: a sample gets the same draw whatever the micro-batch,
data-parallel layout or device it lands on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DENSITIES = ("logit_normal", "mode", "uniform")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


@dataclass
class FlowMatchingConfig:
    """Timestep sampling, loss weighting and classifier-free-guidance dropout.

    Args:
        timestep_density: ``logit_normal`` (SD3's default), ``mode`` or ``uniform``.
        logit_mean, logit_std: of ``logit_normal``.
        mode_scale: of ``mode``.
        shift: ``scheduler`` (the model's scheduler config: dynamic by image size, or its static ``shift``), or a
            number (a static shift ``s * sigma / (1 + (s - 1) * sigma)``; 1 = none).
        loss_weighting: ``none``, ``sigma_sqrt`` or ``cosmap``.
        condition_dropout: probability that a sample trains on the empty caption instead of its own (so the model
            keeps an unconditional prediction for classifier-free guidance); 0 = never.
    """

    timestep_density: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: str | float = "scheduler"
    loss_weighting: str = "none"
    condition_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.timestep_density not in DENSITIES:
            raise ValueError(f"flow_matching.timestep_density={self.timestep_density!r} is not one of {DENSITIES}")
        if self.loss_weighting not in WEIGHTINGS:
            raise ValueError(f"flow_matching.loss_weighting={self.loss_weighting!r} is not one of {WEIGHTINGS}")
        if self.shift != "scheduler" and not (isinstance(self.shift, (int, float)) and self.shift > 0):
            raise ValueError(f"flow_matching.shift={self.shift!r} must be 'scheduler' or a positive number")
        if not 0.0 <= self.condition_dropout < 1.0:
            raise ValueError(f"flow_matching.condition_dropout={self.condition_dropout} must be in [0, 1)")


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The CPU generator of one sample at one optimizer step."""
    # a 63-bit mix of the three numbers (Python's hash of a tuple is not stable across processes for all types)
    mixed = (seed * 1_000_003 + step) * 2_147_483_647 + index
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


def static_shift(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * sigma / (1 + (shift - 1) * sigma)


def shifted_sigmas(u: torch.Tensor, cfg: FlowMatchingConfig, scheduler: dict[str, Any],
                   image_seq_len: int) -> torch.Tensor:
    """``u`` in (0, 1) moved by the model's timestep shift (see the module docstring)."""
    if cfg.shift != "scheduler":
        return static_shift(u, float(cfg.shift))
    if not scheduler.get("use_dynamic_shifting", False):
        return static_shift(u, float(scheduler.get("shift", 1.0)))
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    mu = calculate_shift(image_seq_len, scheduler.get("base_image_seq_len", 256),
                         scheduler.get("max_image_seq_len", 4096), scheduler.get("base_shift", 0.5),
                         scheduler.get("max_shift", 1.15))
    u = u.clamp(1e-6, 1 - 1e-6)
    if scheduler.get("time_shift_type", "exponential") == "linear":
        return mu / (mu + (1 / u - 1))
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def draw_sample(generator: torch.Generator, cfg: FlowMatchingConfig, scheduler: dict[str, Any],
                latent_shape: tuple[int, ...], image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(noise, sigma, drop_condition)`` of one sample, from its own generator (in this order)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    noise = torch.randn(latent_shape, generator=generator)
    u = compute_density_for_timestep_sampling(cfg.timestep_density, 1, logit_mean=cfg.logit_mean,
                                              logit_std=cfg.logit_std, mode_scale=cfg.mode_scale, generator=generator)
    sigma = shifted_sigmas(u, cfg, scheduler, image_seq_len)
    drop = bool(torch.rand((), generator=generator) < cfg.condition_dropout)
    return noise, sigma[0], drop


def loss_weights(cfg: FlowMatchingConfig, sigmas: torch.Tensor) -> torch.Tensor:
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(cfg.loss_weighting, sigmas)


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_sigma, velocity target)`` for latents ``[B, ...]`` and per-sample ``sigmas [B]``."""
    s = sigmas.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - s) * latents + s * noise, noise - latents
