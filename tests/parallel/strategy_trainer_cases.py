"""Worker side of the Trainer-level tests: ``CausalLM`` + ``MockDataModule`` under ``ParallelStrategy`` on
externally launched gloo ranks (the harness sets the launcher variables; Lightning creates the group)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from parallel_cases import LOSS_TOLERANCE, tiny_config

from lightning_moe import ParallelStrategy
from lightning_moe.data import MockDataModule
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig
from lightning_moe.parallel import ParallelDims

GLOBAL_ROWS, SEQ = 4, 16


class StepRecorder(Callback):
    """Per optimizer step: (step, loss, gradient norm) as the training module reports them."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None and (not self.steps or self.steps[-1][0] != stats.step):
            self.steps.append((stats.step, stats.loss, stats.grad_norm))


def fit(sizes: dict, steps: int, root: Path, ckpt_path: str | None = None, checkpoint_every: int | None = None,
        seq_length: int = SEQ) -> tuple[list, ParallelStrategy]:
    strategy = ParallelStrategy(**sizes)
    recorder = StepRecorder()
    callbacks = [recorder]
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, limit_val_batches=2, val_check_interval=2,
        num_sanity_val_steps=1, gradient_clip_val=0.5,
        callbacks=callbacks,
    )
    module = CausalLM(model=tiny_config("qwen3_moe"), optimizer=OptimizerConfig(lr=3e-3),
                      scheduler=SchedulerConfig(warmup_iters=2))
    dp = ParallelDims(**sizes, world_size=int(os.environ["LOCAL_WORLD_SIZE"])).dp_size
    data = MockDataModule(seq_length=seq_length, micro_batch_size=GLOBAL_ROWS // dp, global_batch_size=GLOBAL_ROWS,
                          vocab_size=64, num_val_samples=GLOBAL_ROWS)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return recorder.steps, strategy


def resume_on_another_mesh(directory: str) -> None:
    """Four steps with 2-way FSDP (checkpoints every two), then steps 3-4 again from the step-2 checkpoint
    with 2-way tensor parallelism: the same losses and gradient norms. Both runs validate before training
    and every two steps (forwards without backward in between training steps)."""
    root = Path(directory)
    full, fsdp = fit({"dp_shard": 2}, 4, root / "fsdp", checkpoint_every=2)
    assert fsdp.parallel_sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    assert (fsdp.data_parallel_size, fsdp.data_parallel_rank) == (2, dist.get_rank())
    assert dist.get_world_size(fsdp.loss_reduction_group) == 2
    checkpoint = next((root / "fsdp" / "ckpt").glob("*step=2.ckpt"))
    assert checkpoint.is_dir(), "expected a distributed (DCP) checkpoint directory"
    resumed, tp = fit({"tp": 2}, 4, root / "tp", ckpt_path=str(checkpoint))
    assert (tp.data_parallel_size, tp.data_parallel_rank) == (1, 0)
    assert [s for s, _, _ in resumed] == [3, 4], resumed
    for (step, loss, norm), (_, expected_loss, expected_norm) in zip(resumed, full[2:]):
        assert abs(loss - expected_loss) <= LOSS_TOLERANCE, (step, loss, expected_loss)
        assert abs(norm - expected_norm) <= 1e-4 * expected_norm, (step, norm, expected_norm)
