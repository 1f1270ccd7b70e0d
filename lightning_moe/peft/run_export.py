"""Export a LoRA run from its Lightning checkpoint: the HF PEFT adapter and/or the merged HF model.

A LoRA checkpoint holds adapters and buffers only; the frozen weights come back from the run's ``pretrained``
base, rebuilt exactly as the run built its model (same config, targets and seed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.checkpoint.run import model_tensors, read_run_checkpoint, trained_hyperparameters


def load_lora_run(ckpt: str | Path) -> tuple[nn.Module, Any]:
    """The adapted model of a LoRA run's Lightning checkpoint (a ``.ckpt`` file or a distributed checkpoint
    directory), and the checkpoint source of its base."""
    from lightning_moe.checkpoint.load import copy_tensors_into
    from lightning_moe.checkpoint.source import open_checkpoint
    from lightning_moe.modules.causal_lm import build_decoder

    path = Path(ckpt).expanduser()
    checkpoint = read_run_checkpoint(path)
    hparams = trained_hyperparameters(checkpoint)
    if hparams.get("peft") is None:
        raise ValueError(f"{path}: the run has no `peft` settings, so it is not a LoRA run")
    from lightning_moe.models.hf import HFModelConfig

    if isinstance(hparams.get("model"), HFModelConfig):
        raise ValueError(f"{path}: a LoRA run of a transformers model (model.hf) exports merged with "
                         f"`lightning-moe convert export --ckpt`; PEFT adapter export covers native models")
    if hparams.get("pretrained") is None:
        raise ValueError(f"{path}: the run has no `pretrained` base; a LoRA checkpoint does not hold frozen weights")
    source = open_checkpoint(Path(hparams["pretrained"]).expanduser())
    peft = hparams["peft"]
    model = build_decoder(hparams.get("model") or source.config, seed=hparams.get("seed", 0), source=source,
                          peft=peft)
    copy_tensors_into(model, model_tensors(checkpoint))
    return model.eval(), source


def export_lora_run(ckpt: str | Path, *, adapter_out: str | Path | None = None, merged_out: str | Path | None = None,
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> list[Path]:
    """Write the run's HF PEFT adapter (``adapter_out``) and/or merged HF model (``merged_out``)."""
    from lightning_moe.peft.hf_adapter import export_hf_adapter
    from lightning_moe.peft.merge import export_merged_hf

    if adapter_out is None and merged_out is None:
        raise ValueError("export_lora_run: give adapter_out and/or merged_out")
    model, source = load_lora_run(ckpt)
    hf_config = getattr(source, "hf_config", None)
    written = []
    if adapter_out is not None:
        written.append(export_hf_adapter(model, adapter_out, hf_config=hf_config, dtype=dtype, overwrite=overwrite))
    if merged_out is not None:
        written.append(export_merged_hf(model, merged_out, hf_config=hf_config, dtype=dtype,
                                        aux_dir=source.directory, overwrite=overwrite))
    return written
