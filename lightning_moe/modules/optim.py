"""AdamW and the warmup + cosine (or linear / constant) schedule with Megatron-Bridge's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass
class OptimizerConfig:
    """AdamW. Weight decay applies to matrices only: not to norms, biases (stacked per-expert biases included)
    or other 1-D parameters."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # None: torch's fused kernel (one pass, no per-parameter temporaries) where it exists (CPU, CUDA)
    fused: bool | None = None

    def __post_init__(self) -> None:
        check_finite("optimizer", lr=self.lr, weight_decay=self.weight_decay, eps=self.eps,
                     **{f"betas[{i}]": b for i, b in enumerate(self.betas)})
        if self.lr < 0 or self.eps <= 0 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer: lr must be >= 0, eps > 0 and betas in [0, 1); got lr={self.lr}, "
                             f"eps={self.eps}, betas={tuple(self.betas)}")


@dataclass
class SchedulerConfig:
    """Linear warmup for ``warmup_iters`` steps, then decay to ``min_lr`` at ``lr_decay_iters``, then flat.

    ``lr_decay_iters=None`` decays over the run (``trainer.max_steps``).
    """

    warmup_iters: int = 0
    lr_decay_iters: int | None = None
    min_lr: float = 0.0
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"

    def __post_init__(self) -> None:
        check_finite("scheduler", min_lr=self.min_lr)


def check_finite(group: str, **values: float) -> None:
    """Hyperparameters are finite numbers: ``lr: .inf`` in a YAML file would train to NaN weights."""
    for key, value in values.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{group}.{key} = {value!r} is not a finite number")


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            # by name too: stacked expert biases ([experts, dim]) are 2-D
            (decay if param.ndim >= 2 and not name.endswith("bias") else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (check freeze patterns and LoRA targets)")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = cfg.fused
    if fused is None:
        fused = all(p.device.type in ("cpu", "cuda") for p in decay + no_decay) or None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)


def lr_factor(step: int, cfg: SchedulerConfig, max_lr: float, total_steps: int) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based, before the step is taken)."""
    if cfg.warmup_iters > 0 and step < cfg.warmup_iters:
        return (step + 1) / cfg.warmup_iters
    decay_end = cfg.lr_decay_iters or total_steps
    min_factor = cfg.min_lr / max_lr if max_lr > 0 else 0.0
    if cfg.decay_style == "constant" or decay_end <= cfg.warmup_iters:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_iters) / (decay_end - cfg.warmup_iters))
    if cfg.decay_style == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    if cfg.lr_decay_iters is None and total_steps <= 0 and cfg.decay_style != "constant":
        raise ValueError("scheduler: set scheduler.lr_decay_iters or trainer.max_steps (the decay needs an end)")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_lr, total_steps))
