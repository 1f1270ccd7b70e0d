"""A training module's per-step metrics, kept on the device and read back in one copy every few steps.

Reading a device value (``.item()``, ``float(t)``, ``.tolist()``) makes the host wait for the device to finish
everything queued before it; done every step it stops the host from running ahead. The loss, the gradient norm,
the auxiliary and MTP losses and the token counts of each step therefore stay device tensors until a logging step
(every ``log_every_n_steps``, the last step, or when asked), where the values of all the steps since the last read
come back together: one ``torch.stack`` and one copy.
"""

from __future__ import annotations

import math

import torch

from lightning_moe.modules.step_stats import StepStats

# values of a step that are not logged as train/<name> (the callbacks read them)
UNLOGGED = ("tokens", "label_tokens", "skipped")


def planned_optimizer_steps(max_steps: int | None, max_epochs: int | None, batches_per_epoch: float,
                            accumulate_grad_batches: int) -> float:
    """Optimizer steps a fit will run: ``max_steps`` when set (> 0), else epochs x steps per epoch (a
    partial accumulation window at an epoch's end is a step too). ``inf`` for an endless run."""
    if max_steps is not None and max_steps > 0:
        return max_steps
    if max_epochs is None or max_epochs < 0 or not math.isfinite(batches_per_epoch):
        return math.inf
    return max_epochs * math.ceil(batches_per_epoch / max(accumulate_grad_batches, 1))


def trainer_planned_steps(trainer) -> float:
    """:func:`planned_optimizer_steps` of ``trainer``'s settings."""
    return planned_optimizer_steps(trainer.max_steps, trainer.max_epochs, trainer.num_training_batches,
                                   trainer.accumulate_grad_batches)


def logging_step(trainer, step: int | None = None) -> bool:
    """Optimizer step ``step`` (default: the one just completed, ``trainer.global_step``) is one whose values are
    read back and logged: every ``log_every_n_steps`` (Lightning's logging steps), the run's last planned step, a
    stop, ``fast_dev_run``."""
    step = trainer.global_step if step is None else step
    every = trainer.log_every_n_steps
    last = trainer_planned_steps(trainer)
    return bool((every > 0 and step % every == 0) or step >= last or trainer.should_stop or trainer.fast_dev_run)


class StepMetrics:
    """Named values of each optimizer step: device tensors (0-d) or host numbers."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, dict[str, torch.Tensor | float]]] = []
        self.current: dict[str, torch.Tensor | float] = {}

    def set(self, name: str, value: torch.Tensor | float) -> None:
        """A value of the step in progress."""
        self.current[name] = value.detach() if isinstance(value, torch.Tensor) else value

    def end_step(self, step: int) -> None:
        """The step in progress is over: keep its values for the next read."""
        self.pending.append((step, self.current))
        self.current = {}

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """Every kept step's values on the host, in step order (one device-to-host copy for all of them)."""
        pending, self.pending = self.pending, []
        on_device = [(step, name, value) for step, values in pending for name, value in values.items()
                     if isinstance(value, torch.Tensor)]
        read = {}
        if on_device:
            device = on_device[0][2].device
            stacked = torch.stack([value.to(device=device, dtype=torch.float64) for _, _, value in on_device])
            read = {(step, name): value for (step, name, _), value in zip(on_device, stacked.tolist())}
        return [(step, {name: read.get((step, name), value) for name, value in values.items()})
                for step, values in pending]


def step_stats_of(step: int, values: dict[str, float]) -> StepStats:
    """The host record callbacks read (``StepStats``) of one step's values."""
    return StepStats(step=step, loss=values["loss"], tokens=round(values["tokens"]),
                     label_tokens=round(values["label_tokens"]), grad_norm=values.get("grad_norm"),
                     skipped=bool(values.get("skipped", False)))
