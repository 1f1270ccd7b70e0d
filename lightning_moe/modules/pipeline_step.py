"""The training module's side of pipeline parallelism: each micro-batch goes to the runner of the stages (the
strategy's, ``parallel/pipeline_runner.py``), whose step sums join the module's (``training_step`` returns a zero
unconnected to the model, so Lightning's own backward does nothing: the schedule ran every backward)."""

from __future__ import annotations

import torch


def _shard(module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shard = getattr(module.trainer.strategy, "shard_batch", None)
    return shard(batch) if shard is not None else batch


def pipelined_training_step(module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``CausalLM.training_step`` under a pipeline: keep the micro-batch; the step's last one runs the schedule,
    whose loss sums then join the module's step sums. The schedule ran every backward: what is returned for
    Lightning's backward is a zero unconnected to the model (Lightning refuses None on several ranks)."""
    sums = module._pipeline.add(_shard(module, batch), module.trainer.accumulate_grad_batches)
    if sums is not None:
        for name, value in sums.items():
            module._accumulate(module._step_sums, name, value)
    return torch.zeros((), device=module._pipeline.device, requires_grad=True)


def pipelined_eval_step(module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return module._pipeline.evaluate(_shard(module, batch))
