"""Dtype names, in one place: what a user may write for a floating dtype, the safetensors header's codes, and the
codes pipeline stages send ahead of their tensors."""

from __future__ import annotations

import torch

# ``--dtype`` of the commands and ``model.dtype`` of the transformers path
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the strategy's ``param_dtype`` / ``reduce_dtype`` also take the short names
DTYPE_OPTIONS = {**FLOAT_DTYPES, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
# the dtype code of a pipeline stage's header (its index here)
WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def dtype_option(name: str | None, key: str) -> torch.dtype | None:
    """A dtype setting by name (``bfloat16`` / ``bf16`` ...), or a one-line error naming ``key``."""
    if name is None:
        return None
    if name not in DTYPE_OPTIONS:
        raise ValueError(f"{key}={name!r} is not one of {sorted(DTYPE_OPTIONS)} (or null)")
    return DTYPE_OPTIONS[name]
