"""Model converters, applied to the meta-device model before parallelism (in this order): FP8/MXFP8 training
layers (``precision.Float8Config``), LoRA adapters (``peft.LoraConfig``), then freezing by name pattern.

A converter is a config object with ``convert(model)``, as torchtitan's model converters: this layer names the
order without importing the converters' packages, which build on the models.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from lightning_moe.models.freeze import freeze_parameters


class Converter(Protocol):
    def convert(self, model: nn.Module) -> Any: ...


def apply_converters(model: nn.Module, fp8: Converter | None = None, peft: Converter | None = None,
                     freeze: list[str] | None = None) -> None:
    """``fp8``: a ``Float8Config``; ``peft``: a ``LoraConfig``; ``freeze``: parameter-name patterns."""
    for converter in (fp8, peft):
        if converter is not None:
            converter.convert(model)
    if freeze:
        freeze_parameters(model, freeze)
