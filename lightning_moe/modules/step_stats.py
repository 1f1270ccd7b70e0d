"""What one optimizer step did, as the training module reports it to callbacks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """Global figures of one optimizer step (summed over micro-batches and data-parallel ranks)."""

    step: int  # trainer.global_step after the step
    loss: float  # mean token loss of the global batch (main head)
    tokens: int  # all tokens of the global batch, padding included
    label_tokens: int  # tokens that carried a label
    grad_norm: float | None = None
    skipped: bool = False  # the health check discarded the gradients of this step
