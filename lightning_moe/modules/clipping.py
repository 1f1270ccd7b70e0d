"""Gradient clipping of the training modules: by the total norm over any mix of meshes (the strategy's
``clip_grad_norm``), kept on the device with the step's other metrics where the module has them
(``StepMetrics``), otherwise logged and kept in the step's ``StepStats``."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

from lightning_moe.modules.step_metrics import StepMetrics


def clip_gradients(module: LightningModule, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
    """Lightning's ``configure_gradient_clipping`` for ``module`` (whose network is ``module.model``)."""
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: only 'norm' is supported")
    params = [p for p in module.model.parameters() if p.grad is not None]
    if not params:
        return
    max_norm = float(gradient_clip_val) if gradient_clip_val else float("inf")
    clip = getattr(module.trainer.strategy, "clip_grad_norm", None)
    norm = clip(params, max_norm) if clip is not None else torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    metrics = getattr(module, "step_metrics", None)
    if isinstance(metrics, StepMetrics):  # read back with the step's other values
        metrics.set("grad_norm", norm)
        return
    # a module that reports every step on the host (DiffusionModule)
    norm = float(norm)
    module.log("train/grad_norm", norm, rank_zero_only=True)
    if module.step_stats is not None:
        module.step_stats.grad_norm = norm
