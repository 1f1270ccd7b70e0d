"""The run card's collective bytes per optimizer step, per kind and mesh dimension (``parallel/comm.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_moe.models.config import ModelConfig
from lightning_moe.parallel.comm import StepShape, model_comm_bytes
from lightning_moe.row_length import row_length


def comm_bytes_per_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any] | None:
    """``{"<kind> over <mesh dimension>": bytes}`` of this rank's step, or ``{"not counted": why}``; None outside a
    ``ParallelStrategy`` run of a native decoder."""
    try:
        dims = trainer.strategy.parallel_dims
    except (AttributeError, RuntimeError):  # another strategy, or the meshes were never built
        dims = None
    config = getattr(getattr(pl_module, "model", None), "config", None)
    data = trainer.datamodule
    length = row_length(data)
    rows = getattr(data, "micro_batch_size", None)
    if dims is None or not isinstance(config, ModelConfig) or length is None or not rows:
        return None
    options = trainer.strategy.parallel_options
    # under a pipeline the accumulated micro-batches are the schedule's (the runner collects them)
    shape = StepShape(rows=rows, seq_len=length.tokens, micro_batches=trainer.accumulate_grad_batches,
                      dtype=next(pl_module.model.parameters()).dtype, param_dtype=options.param_dtype,
                      reduce_dtype=options.reduce_dtype,
                      activation_checkpointing=options.activation_checkpointing,
                      activation_checkpointing_every=options.activation_checkpointing_every,
                      pipeline_schedule=options.pp_schedule, pipeline_layout=options.pp_layout)
    try:
        counts = model_comm_bytes(config, dims, shape, pp_rank=dims.pp_rank)
    except NotImplementedError as error:
        return {"not counted": str(error)}
    return {f"{kind} over {mesh}": size for (kind, mesh), size in sorted(counts.items())}
