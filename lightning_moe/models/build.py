"""``build_model``: the one sequence every model kind is built by (DESIGN "Converters before sharding").

construct on the meta device -> converters (FP8, LoRA, freezing) -> ``parallelize`` (sharding; a pipeline's
split returns this rank's stages) -> materialize on the device -> initialize from ``seed`` -> the checkpoint's
tensors, each rank only its shards -> LoRA adapters from ``seed``. The native decoder, the transformers and
diffusers wrappers and the pipeline's stages differ only in the steps they pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_moe.models.lora_init import reset_lora_parameters

Step = Callable[[nn.Module], Any]


def build_model(construct: Callable[[], nn.Module], *, materialize: Callable[[nn.Module, Any], None],
                device: torch.device | str = "cpu", seed: int = 0, convert: Step | None = None,
                parallelize: Step | None = None, initialize: Step | None = None, load: Step | None = None) -> nn.Module:
    """The model ``construct()`` makes (on the meta device), through the steps given, in DESIGN order.
    ``initialize`` and the adapters draw from the torch RNG seeded with ``seed`` (the caller's RNG is kept)."""
    model = construct()
    if convert is not None:
        convert(model)
    if parallelize is not None:
        parallelized = parallelize(model)
        model = parallelized if isinstance(parallelized, nn.Module) else model
    materialize(model, device)
    if initialize is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            initialize(model)
    if load is not None:
        load(model)
    if any(".lora_" in name for name, _ in model.named_parameters()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reset_lora_parameters(model)
    return model


def to_empty(model: nn.Module, device) -> None:
    """Materialize a model built under ``torch.device("meta")`` (its buffers are recomputed by initialization)."""
    model.to_empty(device=device)
