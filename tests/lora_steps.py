"""A few AdamW steps on a LoRA model's adapters (random tokens, next-token labels), shared by the adapter tests."""

from __future__ import annotations

import torch
from torch import nn


def train_adapters(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        out = model(ids, labels=torch.roll(ids, -1, 1))
        (out.loss_sum / out.num_label_tokens).backward()
        opt.step()
        opt.zero_grad()
