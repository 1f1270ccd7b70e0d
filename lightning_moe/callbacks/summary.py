"""The model summary at the start of ``fit``, with the package's model FLOPs instead of Lightning's zero.

Lightning's summary counts FLOPs only over an ``example_input_array`` forward, which no module here sets, so
it printed ``Total FLOPs: 0`` above a run card that counts them. This one drops that column and states the
training FLOPs per token and per optimizer step as :class:`~lightning_moe.callbacks.Throughput` counts them
(from the model config at the data module's sequence length; 6 x parameters for models without one).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.flops import flops_per_token, parameter_flops_per_token
from lightning_moe.row_length import row_length


def model_flops(pl_module: pl.LightningModule, datamodule: Any) -> dict[str, Any]:
    """Training FLOPs per token and per optimizer step (None where the data module does not say its sizes)."""
    params = list(pl_module.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad) / max(total, 1)
    rows = row_length(datamodule)
    seq_length = rows.tokens if rows is not None else None
    config = getattr(getattr(pl_module, "model", None), "config", None)
    if isinstance(config, ModelConfig):
        per_token, method = flops_per_token(config, seq_length, trainable), "model config"
    else:
        per_token, method = parameter_flops_per_token(total, trainable), "6 x parameters"
    global_batch = getattr(datamodule, "global_batch_size", None)
    per_step = per_token * seq_length * global_batch if seq_length and global_batch else None
    return {"per_token": per_token, "per_step": per_step, "method": method, "seq_length": seq_length}


class ModelSummary(RichModelSummary):
    """Lightning's rich model summary without its FLOPs column, plus the model FLOPs of a training step."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        summary = summarize(pl_module, max_depth=self._max_depth)
        columns = [column for column in summary._get_summary_data() if column[0] != "FLOPs"]
        self.render(columns, summary.total_parameters, summary.trainable_parameters, summary.model_size,
                    model_flops(pl_module, trainer.datamodule))

    @staticmethod
    def render(columns: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
               model_size: float, flops: dict[str, Any]) -> None:
        from rich import get_console
        from rich.table import Table

        table = Table(header_style="bold magenta")
        table.add_column(" ", style="dim")
        for name, _ in columns[1:]:
            table.add_column(name, justify="right" if name.startswith("Params") else "left")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        lines = [
            f"[bold]Trainable params[/]: {get_human_readable_count(trainable_parameters)}",
            f"[bold]Non-trainable params[/]: {get_human_readable_count(total_parameters - trainable_parameters)}",
            f"[bold]Total params[/]: {get_human_readable_count(total_parameters)}",
            f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(model_size)}",
            f"[bold]Model FLOPs per token (training, {flops['method']}"
            + (f", seq {flops['seq_length']}" if flops["seq_length"] else "") + f")[/]: {flops['per_token']:.4g}",
        ]
        if flops["per_step"] is not None:
            lines.append(f"[bold]Model FLOPs per optimizer step (global batch)[/]: {flops['per_step']:.4g}")
        console = get_console()
        console.print(table)
        for line in lines:
            console.print(line)
