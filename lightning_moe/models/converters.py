"""Model converters, applied to the meta-device model before parallelism (in this order): FP8/MXFP8 training
layers (torchao), LoRA adapters (peft), then freezing by name pattern."""

from __future__ import annotations

from torch import nn


def apply_converters(model: nn.Module, fp8=None, peft=None, freeze: list[str] | None = None) -> None:
    """``fp8``: a ``Float8Config``; ``peft``: a ``LoraConfig``; ``freeze``: parameter-name patterns."""
    if fp8 is not None:
        from lightning_moe.precision import apply_float8

        apply_float8(model, fp8)
    if peft is not None:
        from lightning_moe.peft import apply_lora

        apply_lora(model, peft)
    if freeze:
        from lightning_moe.peft import freeze_parameters

        freeze_parameters(model, freeze)
