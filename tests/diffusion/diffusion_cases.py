"""Training runs of the tiny Qwen-Image pipeline, shared by the single-process tests and the 2-rank FSDP2 workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tiny_qwen_image import RESOLUTION, SAMPLE

from lightning_moe import DiffusionModule, ParallelStrategy, TextToImageDataModule
from lightning_moe.callbacks import RunCard, Throughput
from lightning_moe.models.diffusion import DiffusionModelConfig, FlowMatchingConfig
from lightning_moe.modules.optim import OptimizerConfig


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.step_stats is not None:
            self.losses[pl_module.step_stats.step] = pl_module.step_stats.loss


def fit(pipeline: str, root: str, *, cache: str | None = None, steps: int = 3, fsdp: bool = False, peft=None,
        condition_dropout: float = 0.25, micro_batch_size: int = 2, global_batch_size: int = 4, card: bool = False,
        save_every: int | None = None, resume: str | None = None, **strategy_options):
    """``steps`` optimizer steps on the shipped sample (online) or its latent cache; returns the per-step losses,
    the module and the trainer."""
    losses = StepLosses()
    callbacks = [losses] + ([Throughput(), RunCard(print_card=False)] if card else [])
    if save_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=Path(root) / "checkpoints", every_n_train_steps=save_every,
                                         save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_steps=steps,
        strategy=ParallelStrategy(dp_shard=2, activation_checkpointing="full") if fsdp
        else ParallelStrategy(**strategy_options),
        logger=False, enable_checkpointing=save_every is not None, enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root, callbacks=callbacks,
    )
    module = DiffusionModule(
        model=DiffusionModelConfig(path=pipeline, encoder_dtype="float32"),
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.0),
        flow_matching=FlowMatchingConfig(condition_dropout=condition_dropout), peft=peft,
        export_dir=str(Path(root) / "export"), export_dtype=None,
    )
    data = TextToImageDataModule(dataset=None if cache else str(SAMPLE), cache_dir=cache, resolution=RESOLUTION,
                                 micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return [losses.losses[s] for s in sorted(losses.losses)], module, trainer


def fit_fsdp(pipeline: str, cache: str, root: str) -> None:
    """Worker: 2-way FSDP2 with activation checkpointing, one cached row per rank per step; rank 0 records."""
    import torch.distributed as dist

    losses, module, _ = fit(pipeline, root, cache=cache, fsdp=True, micro_batch_size=1, global_batch_size=2)
    sharded = [n for n, p in module.model.named_parameters() if type(p).__name__ == "DTensor"]
    if dist.get_rank() == 0:
        (Path(root) / "run.json").write_text(json.dumps(
            {"losses": losses, "sharded": len(sharded), "units": sorted(module.model.layers)}))
