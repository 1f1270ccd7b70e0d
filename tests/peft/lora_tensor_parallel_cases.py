"""Worker side of the tensor-parallel LoRA run test: a LoRA fine-tune under ``ParallelStrategy(tp=...)`` (or on
one process) that writes its last checkpoint and its per-step losses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_moe import ParallelStrategy
from lightning_moe.data import MockDataModule
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig
from lightning_moe.peft import LoraConfig

# dense and MoE layers (the stacked experts adapted too); layer 1's MLP left out
LORA = LoraConfig(r=4, alpha=8, target_experts=True, exclude_modules=["layers.1.mlp.*"])
STEPS = 3


class Losses(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None:
            self.steps[stats.step] = stats.loss


def fit_lora(base: str, root: str, sizes: dict | None) -> None:
    """``STEPS`` optimizer steps of 2 micro-batches; ``sizes`` None: one process with Lightning's default strategy."""
    root = Path(root)
    losses = Losses()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if sizes is not None else 1
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=ParallelStrategy(**sizes) if sizes is not None else "auto",
        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        limit_val_batches=0, callbacks=[losses, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=STEPS)],
    )
    module = CausalLM(pretrained=base, peft=LORA, optimizer=OptimizerConfig(lr=1e-2))
    data = MockDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=160, num_val_samples=0)
    trainer.fit(module, datamodule=data)
    if trainer.global_rank == 0:
        (root / "losses.json").write_text(json.dumps([losses.steps[s] for s in sorted(losses.steps)]))
    if dist.is_initialized():
        dist.barrier()
