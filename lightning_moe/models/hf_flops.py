"""Training FLOPs of a transformers model on the generic path (``model: {hf: ...}``).

Where the transformers config maps to a native family, its ``ModelConfig`` is counted by
:mod:`lightning_moe.models.flops` like a native model. Otherwise the model's own class, built from its config
on the meta device and run on fake tensors (shapes only, nothing allocated: the full-size model costs no
memory), is counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of a
``[1, L]`` fully labelled sequence at two lengths, ``L`` and ``L / 2`` (``L``: the first micro-batch's row
length). The two counts fix ``a L + b L^2`` per sequence (linear terms, and causal attention's quadratic
one); a micro-batch costs that summed over its real packed sequences.

Approximations, stated in the run card's ``flops_method``:
- the experts run transformers' ``batched_mm`` implementation in the count (one ``bmm`` per routed token:
  exactly the routed work, no data-dependent shapes); ``FlopCounterMode`` has no formula for
  ``_grouped_mm``, which training may use;
- attention runs eagerly in the count and so counts the full ``L x L`` score square of each sequence (the
  native count takes the causal half);
- every token is scored by the output layer (the fused loss of training scores labelled tokens only);
- with frozen weights (LoRA) the backward is scaled to ``(1 + trainable fraction) / 2`` of the counted one
  (input gradients always, weight gradients for the trainable share), adapters' own FLOPs left out;
- chunked linear attention is quadratic within a chunk, so lengths far from ``L`` and ``L / 2`` fit less
  exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_moe.models.block_flops import Sequences
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.fake_tensors import BalancedShapes, fake_model
from lightning_moe.models.families import family_for_hf_config

COUNTED_EXPERTS_IMPLEMENTATION = "batched_mm"


def native_model_config(hf_config) -> ModelConfig | None:
    """The native family's ``ModelConfig`` of a transformers config, or None where no family maps it."""
    config = hf_config.to_dict()
    try:
        family = family_for_hf_config(config)
    except ValueError:
        return None
    return family.from_hf_config(config)


def training_step_flops(model_class: type[nn.Module], hf_config, seq_len: int) -> tuple[float, float]:
    """Forward and backward FLOPs of ``model_class`` built from ``hf_config`` on one fully labelled
    ``[1, seq_len]`` sequence, counted on fake tensors."""
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    config._experts_implementation = COUNTED_EXPERTS_IMPLEMENTATION
    # eager attention: its matmuls are counted (FlopCounterMode has no formula for sdpa's CPU kernel)
    config._attn_implementation = "eager"
    config.use_cache = False
    mode, model = fake_model(lambda: model_class._from_config(config, dtype=torch.float32))
    model.train()
    with mode, BalancedShapes(1):
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        with FlopCounterMode(display=False) as forward:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    return float(forward.get_total_flops()), float(backward.get_total_flops())


@dataclass
class CountedFlops:
    """``a L + b L^2`` forward and backward FLOPs per sequence of ``L`` tokens, fitted on first use."""

    model_class: type[nn.Module]
    hf_config: object
    _fit: tuple[float, float, float, float] | None = field(default=None, init=False)

    def fit(self, seq_len: int) -> None:
        long, short = max(seq_len, 2), max(seq_len, 2) // 2
        (f_long, b_long), (f_short, b_short) = (training_step_flops(self.model_class, self.hf_config, n)
                                                for n in (long, short))

        def solve(at_long: float, at_short: float) -> tuple[float, float]:
            quadratic = (at_long / long - at_short / short) / (long - short)
            return at_long / long - quadratic * long, quadratic

        self._fit = (*solve(f_long, f_short), *solve(b_long, b_short))

    def batch_flops(self, position_ids: torch.Tensor | np.ndarray, trainable_fraction: float = 1.0) -> float:
        """Training FLOPs of one micro-batch, from its real packed sequence lengths (``[batch, seq]`` positions)."""
        if self._fit is None:
            self.fit(position_ids.shape[-1])
        lengths = Sequences.from_position_ids(position_ids).lengths.astype(np.float64)
        fa, fb, ba, bb = self._fit
        forward = float((fa * lengths + fb * lengths**2).sum())
        backward = float((ba * lengths + bb * lengths**2).sum())
        return forward + backward * (1.0 + trainable_fraction) / 2.0


COUNTED_METHOD = (
    "FlopCounterMode on a fake-tensor forward+backward of the model's own class at the first row length L and "
    "L/2 (experts as batched_mm, eager attention: full score square), fitted a*L + b*L^2 per packed sequence"
)
