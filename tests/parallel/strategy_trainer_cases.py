"""Worker side of the Trainer-level tests: ``CausalLM`` + ``MockDataModule`` under ``ParallelStrategy`` on
externally launched gloo ranks (the harness sets the launcher variables; Lightning creates the group)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from parallel_cases import LOSS_TOLERANCE, full, tiny_config

from lightning_moe import ParallelStrategy
from lightning_moe.callbacks import Throughput
from lightning_moe.data import MockDataModule
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.flops import batch_flops
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


class AccumulationProbe(CausalLM):
    """Gives each micro-batch a different number of label tokens and records, on every rank: the weights at the
    start (full tensors), the first step's micro-batches, whether ``param.grad`` exists after each micro-batch's
    backward, and the first step's gradients as the optimizer sees them (normalized, before clipping)."""

    def on_train_start(self) -> None:
        self.initial = {name: full(p).detach().clone() for name, p in self.model.named_parameters()}
        self.first_batches, self.grads_written, self.first_grads, self.grads_partial = {}, [], {}, []

    def on_train_batch_start(self, batch, batch_idx):
        # in place, so that callbacks see the same labels
        dp_rank = self.trainer.strategy.data_parallel_rank  # tensor-parallel peers share the batch
        batch["labels"][:, : 3 * dp_rank + 2 * batch_idx + 1] = -100
        batch.pop("num_label_tokens", None)
        batch.pop("layout", None)  # describes the labels as collated
        if self.trainer.global_step == 0:
            self.first_batches[(dp_rank, batch_idx)] = {k: v.clone() for k, v in batch.items()}

    def on_after_backward(self) -> None:
        self.grads_written.append(any(p.grad is not None for p in self.model.parameters()))
        self.grads_partial.append(any(any(placement.is_partial() for placement in getattr(p.grad, "placements", ()))
                                      for p in self.model.parameters() if p.grad is not None))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if not self.first_grads:
            self.first_grads = {n: full(p.grad).clone() for n, p in self.model.named_parameters() if p.grad is not None}
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class AllReduceEveryMicroBatch(ParallelStrategy):
    """HSDP as without deferral: the replicas all-reduce after every micro-batch."""

    @contextmanager
    def block_backward_sync(self):
        yield


def fit_accumulated(sizes: dict, root: Path, strategy_class: type = ParallelStrategy,
                    steps: int = 3) -> tuple[AccumulationProbe, list]:
    """``steps`` steps of two micro-batches each (gradient clipping at 0.5), with the Throughput callback."""
    recorder = StepRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy_class(**sizes),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, limit_val_batches=0, gradient_clip_val=0.5,
        callbacks=[recorder, Throughput()],
    )
    module = AccumulationProbe(model=tiny_config("qwen3_moe"), optimizer=OptimizerConfig(lr=3e-3))
    dp = ParallelDims(**sizes, world_size=int(os.environ["LOCAL_WORLD_SIZE"])).dp_size
    data = MockDataModule(seq_length=SEQ, micro_batch_size=GLOBAL_ROWS // dp // 2, global_batch_size=GLOBAL_ROWS,
                          vocab_size=64, num_val_samples=0)
    trainer.fit(module, datamodule=data)
    assert trainer.accumulate_grad_batches == 2
    return module, recorder.steps


def check_first_step_against_one_process(probe: AccumulationProbe, first_loss: float) -> None:
    """The first step's loss and gradients are those of one process on the whole global batch: the sum of its
    token losses over its label tokens. Throughput counts the global batch's tokens, label tokens and model
    FLOPs once (not once per rank) and divides them by the world size per GPU."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, probe.first_batches)
    batches = {key: batch for rank_batches in gathered for key, batch in rank_batches.items()}
    assert sum(batch["input_ids"].shape[0] for batch in batches.values()) == GLOBAL_ROWS, sorted(batches)
    reference = Decoder(tiny_config("qwen3_moe"))
    reference.load_state_dict(probe.initial, strict=False)
    total, labels = 0.0, 0
    for batch in batches.values():
        out = reference(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        total, labels = total + out.loss_sum, labels + int(out.num_label_tokens)
    (total / labels).backward()
    assert abs(first_loss - total.item() / labels) <= LOSS_TOLERANCE, (first_loss, total.item() / labels)
    speed = next(cb for cb in probe.trainer.callbacks if isinstance(cb, Throughput)).history.values()[0]
    flops = sum(batch_flops(reference.config, b["position_ids"], b["labels"]) for b in batches.values())
    assert (speed.tokens, speed.label_tokens) == (GLOBAL_ROWS * SEQ, labels), speed
    assert abs(speed.flops - flops) <= 1e-9 * flops, (speed.flops, flops)
    per_gpu = speed.rates(dist.get_world_size(), None)["tokens_per_s_per_gpu"]
    assert abs(per_gpu * speed.step_time_s * dist.get_world_size() - GLOBAL_ROWS * SEQ) < 1e-6
    for name, param in reference.named_parameters():
        assert torch.allclose(probe.first_grads[name], param.grad, rtol=1e-4, atol=1e-7), name


def accumulation_matches_one_process(directory: str) -> None:
    """Two micro-batches per step with uneven label counts. HSDP over 2 replicas: the all-reduce across replicas
    waits for the last micro-batch, and the losses, gradient norms and gradients equal those of all-reducing
    every micro-batch. HSDP, and tensor parallelism (replicated weights whose partial gradients accumulate
    over micro-batches and are summed once, after the last), train the first step like one process."""
    sizes = {"dp_replicate": 2, "dp_shard": 1}
    deferred, deferred_steps = fit_accumulated(sizes, Path(directory) / "deferred")
    synchronous, synchronous_steps = fit_accumulated(sizes, Path(directory) / "sync", AllReduceEveryMicroBatch)
    assert deferred.grads_written == [False, True] * 3, deferred.grads_written
    assert synchronous.grads_written == [True, True] * 3, synchronous.grads_written
    for (step, loss, norm), (_, sync_loss, sync_norm) in zip(deferred_steps, synchronous_steps, strict=True):
        assert abs(loss - sync_loss) <= 1e-6 * abs(sync_loss), (step, loss, sync_loss)
        assert abs(norm - sync_norm) <= 1e-5 * sync_norm, (step, norm, sync_norm)
    for name, grad in synchronous.first_grads.items():
        assert torch.allclose(deferred.first_grads[name], grad, rtol=1e-5, atol=1e-8), name
    check_first_step_against_one_process(deferred, deferred_steps[0][1])

    tensor_parallel, tp_steps = fit_accumulated({"tp": 2}, Path(directory) / "tp", steps=1)
    # replicated parameters' partial gradients are summed once per step, after the last micro-batch
    assert tensor_parallel.grads_partial == [True, False], tensor_parallel.grads_partial
    check_first_step_against_one_process(tensor_parallel, tp_steps[0][1])
