"""Both sides of the Trainer-level generic-path tests: ``CausalLM(model=HFModelConfig(...))`` + ``MockDataModule``
on one process (the reference) and under ``ParallelStrategy`` on externally launched gloo ranks; and the worker side
of a model-level tensor-parallel check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tiny_hf_models import VOCAB, batch

from lightning_moe import ParallelStrategy
from lightning_moe.checkpoint.convert import export_model
from lightning_moe.checkpoint.hf_model import gathered_state_dict
from lightning_moe.data import MockDataModule
from lightning_moe.models.hf import HFModelConfig
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig

GLOBAL_ROWS, SEQ = 4, 16


class StepLosses(Callback):
    """The global loss of every optimizer step, as the training module reports it."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None:
            self.losses[stats.step] = stats.loss


def fit(model_dir: str, root: str, sizes: dict | None = None, steps: int = 2, micro_batch_size: int = 2,
        checkpoint: bool = False, native: str = "auto", hf_options: dict | None = None,
        **module_options) -> tuple[list, CausalLM]:
    """``sizes``: ParallelStrategy sizes on the launched ranks; None: one process, Lightning's default strategy.
    Micro-batches of 2 rows: one per rank under 2-way FSDP, two accumulated ones on one process, so the
    router load-balancing loss (a mean over each micro-batch's tokens) is computed on the same rows.
    ``checkpoint``: save the last step under ``root/ckpt``; ``hf_options``: further HFModelConfig fields."""
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    losses = StepLosses()
    callbacks = [losses]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=steps, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=ParallelStrategy(**sizes) if sizes else "auto", max_steps=steps,
        logger=False, enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, limit_val_batches=0, gradient_clip_val=1.0, callbacks=callbacks,
    )
    module = CausalLM(model=HFModelConfig(hf=model_dir, native=native, **(hf_options or {})), optimizer=OptimizerConfig(lr=1e-2),
                      scheduler=SchedulerConfig(warmup_iters=0, decay_style="constant"), **module_options)
    data = MockDataModule(seq_length=SEQ, micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_ROWS,
                          vocab_size=VOCAB, num_val_samples=0)
    trainer.fit(module, datamodule=data)
    return [losses.losses[s] for s in sorted(losses.losses)], module


def fit_fsdp_and_export(model_dir: str, root: str) -> None:
    """2-way FSDP with full activation checkpointing and a distributed checkpoint of the last step; then the
    export (collective, rank 0 writes), the gathered weights and the logits of a fixed batch, for the test to
    compare with transformers."""
    out = Path(root)
    losses, module = fit(model_dir, root, {"dp_shard": 2, "activation_checkpointing": "full"}, checkpoint=True,
                         native="never")
    export_model(module.model, out / "export")
    state = gathered_state_dict(module.model.hf)
    with torch.no_grad():
        logits = module.model(batch()["input_ids"])
    sharded = sum(1 for p in module.model.parameters() if type(p).__name__ == "DTensor")
    if dist.get_rank() == 0:
        torch.save({"state": state, "logits": logits}, out / "trained.pt")
        (out / "losses.json").write_text(json.dumps({"losses": losses, "sharded_parameters": sharded}))


def fit_tensor_parallel(model_dir: str, root: str, sizes: dict | None = None, steps: int = 2) -> None:
    """2-way tensor parallelism with the model's own tp_plan (a dense model forced through transformers), and with
    FSDP over the other ranks when ``sizes`` say so."""
    losses, module = fit(model_dir, root, sizes or {"tp": 2}, steps=steps, native="never")
    sharded = {n for n, p in module.model.hf.named_parameters() if type(p).__name__ == "DTensor"}
    if dist.get_rank() == 0:
        (Path(root) / "losses.json").write_text(json.dumps({"losses": losses, "sharded": sorted(sharded)}))


def tensor_parallel_fsdp_gradients(model_dir: str, out: str) -> None:
    """One loss and backward of a fixed batch under tp=2 x dp_shard=2 (each data-parallel pair its half of the
    rows): the summed loss and every full gradient, FSDP's mean over the pairs undone."""
    from lightning_moe.models.hf import build_hf_model
    from lightning_moe.parallel import ParallelDims, parallelize

    dims = ParallelDims(tp=2, dp_shard=2, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"), parallelize=lambda m: parallelize(m, dims))
    data = {key: value.chunk(dims.dp_size)[dims.dp_rank] for key, value in batch(rows=4).items()}
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) * dims.dp_size
             for n, p in model.hf.named_parameters()}
    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.mesh("dp").get_group())
    if dist.get_rank() == 0:
        torch.save({"loss": total, "grads": grads}, out)


def tensor_parallel_gradients(model_dir: str, out: str) -> None:
    """One loss and backward of a fixed batch under 2-way tensor parallelism with the model's own plan (transformers'
    path forced): the loss sum, every full gradient, and whether a tied output layer is still the embedding."""
    from lightning_moe.models.hf import build_hf_model
    from lightning_moe.parallel import ParallelDims, parallelize

    dims = ParallelDims(tp=2, world_size=2)
    dims.build_meshes("cpu")
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"), parallelize=lambda m: parallelize(m, dims))
    data = batch()
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.hf.named_parameters()}
    tied = model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight
    if dist.get_rank() == 0:
        torch.save({"loss": loss.detach(), "grads": grads, "tied": tied}, out)
