"""``predict`` results as JSON lines: the prompts of a ``PromptsDataModule``, continued on every rank, in one file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from lightning_moe.io.atomic import atomic_write_text

PREDICTIONS = "predictions.jsonl"


class PredictionWriter(BasePredictionWriter):
    """After ``predict``, writes one JSON line per prompt, in the prompts' order: ``index``, ``prompt``, the
    generated ``text`` and its ``token_ids`` (new tokens only), gathered from every rank.

    Args:
        output: the JSONL file (default: ``<default_root_dir>/predictions.jsonl``).
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        data = trainer.datamodule
        if not hasattr(data, "prompts") or not hasattr(data, "tokenizer"):
            return  # not prompts: nothing of this writer's kind to write
        found: dict[int, list[int]] = {}
        for batch in _batches(predictions):
            found.update(zip(batch["index"], batch["token_ids"]))
        if dist.is_available() and dist.is_initialized():
            shares: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(shares, found)
            found = {index: tokens for share in shares for index, tokens in share.items()}
        if not trainer.is_global_zero:
            return
        missing = sorted(set(range(len(data.prompts))) - set(found))
        if missing:
            raise RuntimeError(f"PredictionWriter: no prediction for prompt(s) {missing[:5]}")
        path = Path(self.output or Path(trainer.default_root_dir) / PREDICTIONS)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"index": i, "prompt": data.prompts[i], "token_ids": found[i],
                             "text": data.tokenizer.decode(found[i], skip_special_tokens=True)}, ensure_ascii=False)
                 for i in sorted(found)]
        atomic_write_text(path, "".join(line + "\n" for line in lines))
        rank_zero_info(f"wrote {len(lines)} prediction(s) to {path}")


def _batches(predictions: Any):
    """The per-batch outputs, from one or several predict dataloaders."""
    for item in predictions:
        if isinstance(item, list):
            yield from item
        else:
            yield item
