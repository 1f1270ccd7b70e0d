"""A tiny LightningModule around a tiny Decoder, random packed batches and a Trainer factory for callback tests.

The module reports each optimizer step in ``step_stats`` the way the training module does (global mean loss,
tokens, label tokens), written in ``on_before_optimizer_step`` so callbacks find it at the step's end.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.modules.step_stats import StepStats

VOCAB, SEQ, MICRO_BATCH = 96, 32, 2


def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=32, pattern="*-*-",
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8),
        mlp=MLPConfig(intermediate_size=64), max_position_embeddings=SEQ,
    )


class PackedRows(Dataset):
    """Rows of SEQ tokens; odd rows pack two sequences (positions restart at 12), even rows are one sequence.
    A quarter of the labels are -100."""

    def __init__(self, rows: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
        self.labels = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
        self.labels[torch.rand(rows, SEQ, generator=gen) < 0.25] = -100
        self.position_ids = torch.arange(SEQ).repeat(rows, 1)
        self.position_ids[1::2] = torch.cat([torch.arange(12), torch.arange(SEQ - 12)])

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "position_ids": self.position_ids[i]}


def loader(rows: int = 64, seed: int = 0) -> DataLoader:
    return DataLoader(PackedRows(rows, seed), batch_size=MICRO_BATCH, shuffle=False)


class TinyLM(pl.LightningModule):
    """``nan_at_step``: the loss of that optimizer step (1-based) is multiplied by NaN."""

    def __init__(self, nan_at_step: int | None = None, weight_decay: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Decoder(tiny_config())
        self.model.init_weights()
        self.nan_at_step = nan_at_step
        self.weight_decay = weight_decay
        self.step_stats: StepStats | None = None
        self._sums = {"loss": 0.0, "labels": 0, "tokens": 0}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        loss = out.loss_sum / out.num_label_tokens
        if self.nan_at_step == self.trainer.global_step + 1:
            loss = loss * float("nan")
        self._sums["loss"] += float(loss.detach()) * int(out.num_label_tokens)
        self._sums["labels"] += int(out.num_label_tokens)
        self._sums["tokens"] += batch["input_ids"].numel()
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        sums = self._sums
        self.step_stats = StepStats(step=self.trainer.global_step + 1, loss=sums["loss"] / sums["labels"],
                                    tokens=sums["tokens"], label_tokens=sums["labels"])
        self._sums = {"loss": 0.0, "labels": 0, "tokens": 0}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=self.weight_decay)


def make_trainer(tmp_path, callbacks: list, max_steps: int = 4, **kwargs) -> pl.Trainer:
    from lightning.pytorch.loggers import CSVLogger

    options = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1,
        default_root_dir=tmp_path, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)
