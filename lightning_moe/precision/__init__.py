"""Low-precision training: torchao FP8 (tensorwise / rowwise) and MXFP8 converters, emulated where no hardware runs them."""

from lightning_moe.precision.fp8 import RECIPES, Float8Config, Float8Report, apply_float8

__all__ = ["RECIPES", "Float8Config", "Float8Report", "apply_float8"]
