"""Sampling from a transformers model through its own ``generate``: settings, and the new tokens of each prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class SamplingSettings:
    """How to continue each prompt.

    Args:
        max_new_tokens: tokens to generate at most (fewer when an end-of-sequence token comes first).
        temperature: 0 decodes greedily; above 0 samples at this temperature.
        top_p: nucleus sampling: sample from the smallest set of tokens whose probability reaches ``top_p``.
        seed: seed of the sampling (every process adds its global rank).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 decodes greedily)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")

    def generation_config(self, base: Any) -> Any:
        """``base`` (a transformers ``GenerationConfig``: the model's end and pad tokens) with these settings."""
        config = base.__class__.from_dict(base.to_dict())
        config.max_new_tokens = self.max_new_tokens
        config.do_sample = self.temperature > 0
        # greedy decoding ignores the sampling knobs: leave them unset so transformers does not warn about them
        config.temperature = self.temperature if config.do_sample else None
        config.top_p = self.top_p if config.do_sample else None
        config.top_k = config.top_k if config.do_sample else None
        return config


@torch.no_grad()
def new_tokens(hf_model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               generation_config: Any) -> list[list[int]]:
    """The tokens ``generate`` adds to each (left-padded) prompt, up to and including the first end token."""
    config = hf_model.config
    # a router's load-balancing loss is a training term, and transformers' MoE models cannot compute it over a
    # padded batch with a KV cache: the logits are the same without it
    router_loss = getattr(config, "output_router_logits", False)
    if router_loss:
        config.output_router_logits = False
    try:
        out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
    finally:
        if router_loss:
            config.output_router_logits = router_loss
    ends = generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [] if ends is None else [ends])
    rows = []
    for row in out[:, input_ids.shape[1]:].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), None)
        rows.append(row if end is None else row[: end + 1])
    return rows
