"""A run's LightningModule rebuilt from its checkpoint, and ``load_pretrained`` of any checkpoint.

A run started from Python holds the config dataclasses themselves; a run of ``lightning-moe fit`` (LightningCLI)
holds plain dicts plus ``_class_path`` / ``_instantiator``, which jsonargparse turns back into the same
dataclasses by the module's signature (``load_back.instantiate_from_hparams``, as
``LightningModule.load_from_checkpoint`` does). Exports then ask the module how it built its model
(``resolved_config``, ``pretrained``, ``peft``, ``seed``) instead of reading the dict themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_moe.checkpoint.load import load_pretrained as load_native
from lightning_moe.io.run import is_run_checkpoint, read_run_checkpoint
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.load_back import instantiate_from_hparams
from lightning_moe.modules.vision_lm import VisionLM


def run_module(checkpoint: dict[str, Any], where: object = "checkpoint") -> CausalLM:
    """The ``CausalLM`` (or ``VisionLM``) of a run, built from ``checkpoint["hyper_parameters"]`` but without a
    model (``configure_model`` was not called). ``where`` names the checkpoint in errors."""
    return instantiate_from_hparams(run_module_class(checkpoint), checkpoint.get("hyper_parameters") or {}, where)


def run_module_class(checkpoint: dict[str, Any]) -> type[CausalLM]:
    """The module class of a run from Python, by its task (a ``lightning-moe fit`` run names its own)."""
    return VisionLM if checkpoint.get("hf_task") == VisionLM.hf_task else CausalLM


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """A model with trained weights, in eval mode: of a Hugging Face directory or an imported checkpoint (a
    native ``Decoder``), or of a run's Lightning checkpoint (``.ckpt`` file or distributed directory: the run's
    model as ``CausalLM.load_from_checkpoint`` builds it, adapters included)."""
    if not is_run_checkpoint(path):
        return load_native(path, dtype=dtype, device=device)
    cls = run_module_class(read_run_checkpoint(path))
    model = cls.load_from_checkpoint(path, map_location=device).model
    return model.to(dtype) if dtype is not None else model
