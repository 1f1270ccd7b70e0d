"""A native model with the weights of a checkpoint; putting tensors into a model (fresh or sharded) is in
``models.weights``, re-exported here."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_moe.checkpoint.source import open_checkpoint
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.weights import assign_tensors, copy_tensors_into

__all__ = ["assign_tensors", "copy_tensors_into", "load_pretrained"]  # the first two live in models.weights


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Decoder:
    """A native model with the weights of a Hugging Face directory or an imported checkpoint."""
    source = open_checkpoint(path)
    with torch.device("meta"):
        model = Decoder(source.config)
    assign_tensors(model, source.iter_native(), dtype=dtype, device=device)
    return model.eval()
