"""A LoRA-adapted native model written as a full Hugging Face checkpoint, the adapters merged into the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.checkpoint.convert import export_hf_tensors
from lightning_moe.peft.merge import merged_state_dict


def export_merged_hf(model: nn.Module, out: str | Path, *, hf_config: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None, aux_dir: Path | None = None, overwrite: bool = False) -> Path:
    """Write the adapted model as a full Hugging Face checkpoint (adapters merged into the weights)."""
    state = merged_state_dict(model)
    return export_hf_tensors(model.config, state.__getitem__, out, hf_config=hf_config, dtype=dtype,
                             aux_dir=aux_dir, overwrite=overwrite)
