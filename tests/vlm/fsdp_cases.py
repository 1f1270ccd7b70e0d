"""Worker side of the vision-language FSDP test: ``VisionLM`` + ``MedPixDataModule`` on one process (the reference)
and under 2-way FSDP2 (language layers and vision blocks sharded) on externally launched gloo ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from tiny_vlm import SAMPLE

from lightning_moe import HFModelConfig, MedPixDataModule, ParallelStrategy, VisionLM
from lightning_moe.checkpoint.hf_model import gathered_state_dict
from lightning_moe.modules.optim import OptimizerConfig


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.step_stats is not None:
            self.losses[pl_module.step_stats.step] = pl_module.step_stats.loss


def fit(model_dir: str, root: str, fsdp: bool) -> tuple[list[float], VisionLM]:
    """Two steps of two packed rows each: one row per rank under FSDP, two accumulated rows on one process."""
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_steps=2,
        strategy=ParallelStrategy(dp_shard=2, activation_checkpointing="full") if fsdp else "auto",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, limit_val_batches=0, callbacks=[losses],
    )
    module = VisionLM(model=HFModelConfig(hf=model_dir), optimizer=OptimizerConfig(lr=1e-2))
    data = MedPixDataModule(processor=model_dir, dataset=str(SAMPLE / "train.jsonl"), packing="ffd",
                            packed_sequence_size=256, micro_batch_size=1, global_batch_size=2)
    trainer.fit(module, datamodule=data)
    return [losses.losses[s] for s in sorted(losses.losses)], module


def fit_fsdp(model_dir: str, root: str) -> None:
    losses, module = fit(model_dir, root, fsdp=True)
    units = sorted(name for name in module.model.layers)
    sharded = [n for n, p in module.model.named_parameters() if type(p).__name__ == "DTensor"]
    state = gathered_state_dict(module.model.hf)
    if dist.get_rank() == 0:
        torch.save(state, Path(root) / "trained.pt")
        (Path(root) / "run.json").write_text(json.dumps({"losses": losses, "units": units, "sharded": len(sharded)}))
