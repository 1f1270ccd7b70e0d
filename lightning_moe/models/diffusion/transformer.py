"""The trained diffusers transformer behind the interface the package's parallelism helpers use (``layers``: the
repeated blocks that activation checkpointing, compile and FSDP2 take one by one), and its construction: meta
device -> converters (LoRA, freezing) -> parallelize -> materialize -> the pipeline's transformer weights copied in,
each rank keeping only its shards (no rank holds the whole model in memory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.build import build_model
from lightning_moe.models.hf import _layer_units, materialize_with_buffers, parameters_on_meta
from lightning_moe.models.weights import copy_tensors_into


class DiffusionTransformer(nn.Module):
    """``transformer``: a diffusers transformer (``QwenImageTransformer2DModel``); ``family``: its call."""

    mtp = None  # no multi-token-prediction heads: the parallelism helpers look for them

    def __init__(self, transformer: nn.Module, family: Any) -> None:
        super().__init__()

        self.transformer = transformer
        self.family = family
        # found before parallelism: FSDP renames the classes it wraps
        self._unit_names = list(_layer_units(transformer))

    @property
    def config(self):
        return self.transformer.config

    @property
    def layers(self) -> dict[str, nn.Module]:
        return {f"transformer.{name}": self.transformer.get_submodule(name) for name in self._unit_names}

    def forward(self, packed: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                prompt_mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The predicted velocity of packed noisy latents (see the family's ``predict``)."""
        return self.family.predict(self.transformer, packed, sigmas, prompt_embeds, prompt_mask, latent_hw)


def build_diffusion_transformer(family: Any, *, convert: Callable[[nn.Module], None] | None = None,
                                parallelize: Callable[[nn.Module], Any] | None = None,
                                device: torch.device | str = "cpu", seed: int = 0) -> DiffusionTransformer:
    """The family's transformer with its pipeline's weights; adapters (if ``convert`` adds them) start from
    ``seed``. Master weights are float32 whatever the checkpoint's dtype (FSDP's ``param_dtype`` sets the compute
    dtype)."""
    cls = family.transformer_class

    def construct() -> DiffusionTransformer:
        with parameters_on_meta():
            transformer = cls.from_config(cls.load_config(family.transformer_dir)).float()
        return DiffusionTransformer(transformer, family)

    def prepare(model: DiffusionTransformer) -> None:
        if convert is not None:
            convert(model.transformer)
        # never given a gradient: frozen, so optimizers hold no state for them and a resumed run expects none
        for name in family.unused_parameters(model.transformer):
            model.transformer.get_parameter(name).requires_grad_(False)

    def load(model: DiffusionTransformer) -> None:
        reader = SafetensorsDir(family.transformer_dir)
        try:
            copy_tensors_into(model.transformer, ((name, reader.get(name)) for name in reader.keys()))
        finally:
            reader.close()
        expected = {n.replace(".base_layer.", ".") for n in model.transformer.state_dict() if ".lora_" not in n}
        missing = sorted(expected - set(reader.keys()))
        if missing:
            raise ValueError(f"{family.transformer_dir}: no tensor for {', '.join(missing[:3])}"
                             f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''} of {cls.__name__}; a "
                             f"partial checkpoint would start those weights at random")

    return build_model(construct, materialize=materialize_with_buffers, device=device, seed=seed, convert=prepare,
                       parallelize=parallelize, load=load)
