"""The run card: what ran, on what, how fast and how it went, in ``run_card.json`` and ``run_card.md``.

Its fields are those of the verification cards Megatron-Bridge publishes for its recipes (model, workload,
world size and parallel sizes, batch sizes, sequence length, precision, initial and final loss, step time,
TFLOP/s/GPU, tokens/s/GPU, peak memory, skipped and NaN steps, checkpoints, versions, command line), plus the
per-step series that ``lightning-moe report`` plots. Speed, memory and health figures come from the
:class:`Throughput`, :class:`PeakMemory` and :class:`HealthCheck` callbacks of the same trainer (absent ones
leave their fields empty). Written on global rank 0 at the end of ``fit``, and after a failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.utilities import rank_zero_warn

from lightning_moe.callbacks.card_format import CARD_JSON, CARD_MARKDOWN, render_markdown
from lightning_moe.callbacks.comm_card import comm_bytes_per_step
from lightning_moe.callbacks.health import HealthCheck
from lightning_moe.callbacks.memory import PeakMemory
from lightning_moe.callbacks.preemption import Preempted, Preemption
from lightning_moe.callbacks.step_end import StepEndCallback, StepSeries, reports_on_read, step_loss
from lightning_moe.callbacks.throughput import Throughput
from lightning_moe.io.atomic import atomic_write_text
from lightning_moe.kernels import kernel_checks
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.flops import mtp_depths
from lightning_moe.row_length import row_length
from lightning_moe.seeds import global_seed

SERIES_FIELDS = ("step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu")


def find_callback(trainer: pl.Trainer, kind: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


def describe_model(pl_module: pl.LightningModule) -> dict[str, Any]:
    model = getattr(pl_module, "model", None) or pl_module
    params = list(pl_module.parameters())
    info: dict[str, Any] = {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "pretrained": getattr(pl_module, "pretrained", None),
    }
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig):
        info.update(family=config.family, pattern=config.pattern, hidden_size=config.hidden_size,
                    vocab_size=config.vocab_size, attention=config.attention.type, mtp_depths=mtp_depths(config),
                    config=config.to_dict())
    elif config is not None:
        info["config"] = getattr(config, "_name_or_path", None) or type(config).__name__
    return info


def data_shape(datamodule: Any) -> dict[str, Any]:
    """Batch sizes and sequence length, as the data module states them."""
    rows = row_length(datamodule)
    return {
        "global_batch_size": getattr(datamodule, "global_batch_size", None),
        "micro_batch_size": getattr(datamodule, "micro_batch_size", None),
        "seq_length": rows.tokens if rows is not None else None,
    }


def checkpoints_written(trainer: pl.Trainer) -> list[str]:
    """Best and last checkpoints of every checkpoint callback, and whatever else their folders hold."""
    paths: list[str] = []
    for callback in trainer.checkpoint_callbacks:
        paths += [p for p in (getattr(callback, "best_model_path", ""), getattr(callback, "last_model_path", "")) if p]
        folder = getattr(callback, "dirpath", None)
        if folder and os.path.isdir(folder):
            # hidden entries are saves in progress or left unfinished (``.partial``), not checkpoints
            paths += [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if not name.startswith(".")]
    return list(dict.fromkeys(paths))


def logger_locations(trainer: pl.Trainer) -> list[dict[str, str | None]]:
    """Each logger and where it writes (a folder, or a tracking URI / run for W&B and MLflow)."""
    found = []
    for logger in trainer.loggers:
        where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if where is None:
            where = getattr(logger, "_tracking_uri", None) or getattr(logger, "name", None)
        found.append({"logger": type(logger).__name__, "location": None if where is None else str(where)})
    return found


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "lightning", "transformers", "lightning-moe"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    found["cuda"] = torch.version.cuda
    return found


def per_step_series(losses: dict[int, float], speeds: list[dict[str, Any]]) -> dict[str, list]:
    """Aligned per-step arrays (null where a step has no value, or a non-finite one), keyed by ``global_step``
    after each step; ``step`` numbers them as the loggers do (TensorBoard, CSV: ``global_step`` before it)."""
    by_step = {s["step"]: s for s in speeds}
    steps = sorted(set(losses) | set(by_step))
    series: dict[str, list] = {"step": [s - 1 for s in steps], "loss": [finite_or_none(losses.get(s)) for s in steps]}
    for field in SERIES_FIELDS:
        series[field] = [finite_or_none(by_step.get(s, {}).get(field)) for s in steps]
    return series


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def json_safe(value: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def end_status(trainer: pl.Trainer) -> str:
    """How a fit that returned ended: completed, or stopped early by which callback and why."""
    health = find_callback(trainer, HealthCheck)
    if health is not None and health.stopped_at is not None:
        return f"stopped by HealthCheck at step {health.stopped_at}"
    for callback in trainer.callbacks:
        if isinstance(callback, EarlyStopping) and callback.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
            return (f"stopped early by EarlyStopping at step {trainer.global_step}: "
                    f"{callback.stopping_reason_message or callback.stopping_reason.value}")
    if trainer.should_stop and trainer.max_steps > 0 and trainer.global_step < trainer.max_steps:
        return f"stopped at step {trainer.global_step} (trainer.should_stop set by a callback or the module)"
    return "completed"


def seeds_in_force(pl_module: pl.LightningModule, datamodule: Any) -> dict[str, int | None]:
    """The ``seed_everything`` seed and the seeds the weights and the data order used."""
    return {"seed_everything": global_seed(), "model": getattr(pl_module, "seed", None),
            "data": getattr(datamodule, "seed", None)}


class RunCard(StepEndCallback):
    """Writes ``run_card.json`` and ``run_card.md`` into the run directory (``trainer.log_dir``).

    Args:
        name: what the card is titled (a recipe or model name); default: the model class and family.
        workload: what was run (``pretrain``, ``sft``, ``lora``, a benchmark name); default: the data module class.
        print_card: also print the Markdown card to stdout at the end (not after a failure before the first step).
    """

    def __init__(self, name: str | None = None, workload: str | None = None, print_card: bool = True) -> None:
        self.name = name
        self.workload = workload
        self.print_card = print_card
        self.losses = StepSeries()
        self.run_dir: Path | None = None
        self.started = time.time()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # log_dir is a collective (it broadcasts rank 0's choice): resolve it now, while all ranks are here
            self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)
            self.started = time.time()

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if reports_on_read(pl_module):
            return  # the losses come with on_steps_read
        loss = step_loss(trainer, pl_module, outputs)
        if loss is not None:
            self.losses.add(trainer.global_step, loss)

    def on_steps_read(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stats: list) -> None:
        for step in stats:
            self.losses.add(step.step, step.loss)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, pl_module, end_status(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != "fit":  # validate / test / predict never overwrite the card of the fit before them
            return
        status = (f"preempted: {exception}" if isinstance(exception, Preempted)
                  else f"failed: {type(exception).__name__}: {exception}")
        try:
            self.write(trainer, pl_module, status)
        except Exception as error:  # the run's own exception is the one to see
            rank_zero_warn(f"RunCard: could not write the card after the failure: {error}")

    def build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str) -> dict[str, Any]:
        throughput = find_callback(trainer, Throughput)
        memory = find_callback(trainer, PeakMemory)
        health = find_callback(trainer, HealthCheck)
        preemption = find_callback(trainer, Preemption)
        model = describe_model(pl_module)
        losses = self.losses.values()
        datamodule = trainer.datamodule
        pipeline = getattr(trainer.strategy, "pipeline", None)
        finished = time.time()
        return {
            "name": self.name or " ".join(str(x) for x in (model["class"], model.get("family")) if x),
            "status": status,
            "model": model,
            "workload": self.workload or (type(datamodule).__name__ if datamodule is not None else None),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "parallel_sizes": getattr(trainer.strategy, "parallel_sizes", None),
            # what one rank's collectives handle per optimizer step, by kind and mesh dimension
            "comm_bytes_per_step": comm_bytes_per_step(trainer, pl_module),
            "strategy": type(trainer.strategy).__name__,
            # schedule, pp, vp, the split and the measured bubble fraction of a pipelined run
            "pipeline": pipeline.summary() if pipeline is not None else None,
            **data_shape(datamodule),
            # samples read, dropped, truncated or skipped at setup, as the data module counted them
            "data_counts": datamodule.data_counts() if hasattr(datamodule, "data_counts") else None,
            "gradient_accumulation": trainer.accumulate_grad_batches,
            "precision": str(trainer.precision),
            "steps": trainer.global_step,
            "max_steps": trainer.max_steps,
            "seeds": seeds_in_force(pl_module, datamodule),
            "initial_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            **(throughput.summary() if throughput else {}),
            **(memory.summary() if memory else {}),
            **(health.summary() if health else {}),
            "preemption": preemption.record if preemption else None,
            "checkpoints": checkpoints_written(trainer) + ([preemption.record["checkpoint"]]
                                                           if preemption and preemption.record else []),
            "loggers": logger_locations(trainer),
            "versions": versions(),
            "kernel_checks": kernel_checks(),  # compiled kernels checked on first use, and their verdicts
            "command": shlex.join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "wall_time_s": finished - self.started,
            "series": per_step_series(self.losses.by_step, throughput.series() if throughput else []),
        }

    def write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str) -> None:
        if not trainer.is_global_zero or trainer.fast_dev_run:  # a trial run leaves nothing behind
            return
        card = self.build(trainer, pl_module, status)
        run_dir = self.run_dir or Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        markdown = render_markdown(card)
        atomic_write_text(run_dir / CARD_JSON, json.dumps(json_safe(card), indent=2, allow_nan=False) + "\n")
        atomic_write_text(run_dir / CARD_MARKDOWN, markdown)
        if self.print_card and (trainer.global_step > 0 or not status.startswith("failed")):
            # a run that failed before its first step has only the error to say (the card is in run_dir)
            print(markdown, flush=True)
