"""Worker side of the converter tests under ``ParallelStrategy``: LoRA and MXFP8 / FP8 runs on gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_moe import ParallelStrategy
from lightning_moe.checkpoint.source import open_checkpoint
from lightning_moe.data import MockDataModule
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig
from lightning_moe.peft import LoraConfig, is_adapter_parameter
from lightning_moe.precision import Float8Config

LORA = LoraConfig(r=4, alpha=8, target_experts=True, exclude_modules=["layers.1.mlp.*"])
CONVERTERS = {
    "lora": {"peft": LORA},
    "mxfp8": {"fp8": Float8Config(recipe="mxfp8", min_dim=16)},
    "tensorwise": {"fp8": Float8Config(recipe="tensorwise", min_dim=16)},
    "tensorwise_fp8_all_gather": {"fp8": Float8Config(recipe="tensorwise", min_dim=16, fsdp_float8_all_gather=True)},
}


class Losses(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None and (not self.steps or self.steps[-1][0] != stats.step):
            self.steps.append((stats.step, stats.loss))


class SavedAdapters(Callback):
    """Whenever a checkpoint is written, rank 0 also saves the whole adapters, for the export test."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                for n, p in pl_module.model.named_parameters() if is_adapter_parameter(n)}
        if trainer.global_rank == 0:
            root = Path(trainer.default_root_dir)
            root.mkdir(parents=True, exist_ok=True)
            torch.save(full, root / f"adapters-step{trainer.global_step}.pt")


def fit(base: str, root: Path, sizes: dict, converter: str, ckpt_path: str | None = None):
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=ParallelStrategy(**sizes),
        max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        limit_val_batches=0, callbacks=[losses, SavedAdapters(), ModelCheckpoint(dirpath=root / "ckpt",
                                                                                 every_n_train_steps=2, save_top_k=-1)],
    )
    module = CausalLM(pretrained=base, optimizer=OptimizerConfig(lr=1e-2), **CONVERTERS[converter])
    data = MockDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=160, num_val_samples=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, [loss for _, loss in losses.steps]


def run_and_resume(base: str, root: Path, sizes: dict, converter: str):
    """Three steps (a distributed checkpoint at step 2), then step 3 again from that checkpoint."""
    module, losses = fit(base, root / "full", sizes, converter)
    checkpoint = root / "full" / "ckpt" / "epoch=0-step=2.ckpt"
    assert checkpoint.is_dir(), "expected a distributed (DCP) checkpoint"
    _, resumed = fit(base, root / "resumed", sizes, converter, ckpt_path=str(checkpoint))
    assert resumed == losses[2:], (converter, sizes, resumed, losses)
    return module, losses, checkpoint


def check_converters(base: str, directory: str) -> None:
    root = Path(directory)
    # LoRA with FSDP2: the frozen base stays the pretrained weights, checkpoints hold adapters only
    lora, fsdp_losses, checkpoint = run_and_resume(base, root / "lora_fsdp", {"dp_shard": 2}, "lora")
    pretrained = dict(open_checkpoint(base).iter_native())
    for name, param in lora.model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if not is_adapter_parameter(name):
            assert torch.equal(full.detach(), pretrained[name.replace(".base_layer.", ".")]), name
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("state_dict.")]
    assert weights and all(is_adapter_parameter(k) or "score_correction" in k for k in weights), weights
    # the same run with the experts (and their adapters) split over two expert-parallel ranks
    _, ep_losses, _ = run_and_resume(base, root / "lora_ep", {"dp_shard": 2, "ep": 2}, "lora")
    assert max(abs(a - b) for a, b in zip(ep_losses, fsdp_losses)) <= 1e-5, (ep_losses, fsdp_losses)

    run_and_resume(base, root / "mxfp8_fsdp", {"dp_shard": 2}, "mxfp8")
    # FP8 all-gather quantizes the shards with the global scale: the same numbers as gathering bf16 first
    _, plain = fit(base, root / "tensorwise", {"dp_shard": 2}, "tensorwise")
    gathering, gathered = fit(base, root / "tensorwise_ag", {"dp_shard": 2}, "tensorwise_fp8_all_gather")
    assert max(abs(a - b) for a, b in zip(plain, gathered)) <= 1e-5, (plain, gathered)
    # the scales of the gathered FP8 weights were precomputed after the optimizer steps, for the next all-gather
    scales = [p._local_tensor._precomputed_scale for p in gathering.model.parameters()
              if type(getattr(p, "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor"]
    assert scales and all(scale is not None for scale in scales), scales
    dist.barrier()
