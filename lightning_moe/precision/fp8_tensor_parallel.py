"""Tensor-parallel styles for the FP8 and MXFP8 linears of ``precision/fp8.py``, chosen per layer.

* Tensorwise-scaled ``Float8Linear``: torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, as torchtitan
  uses them. The input is cast to FP8 with the scale of the whole (DTensor) tensor before it is all-gathered, and
  output gradients are cast in backward; a module whose input feeds only such layers (attention's q/k/v, an MLP's
  gate/up) gets torchao's ``PrepareFloat8ModuleInput``, so the sequence all-gather moves FP8 values once for all of
  them. These collectives carry float8 tensors, which gloo cannot: on gloo (CPU runs) the layers get torch's
  styles instead, with the same scales and numbers.
* Rowwise-scaled ``Float8Linear`` and ``MXFP8Linear``: torch's column/row-wise styles, as torchtitan uses them.
  Their scales are per row or per 32-element block; on DTensor arguments the amax reductions over a split
  dimension run over the whole tensor, so every scale is the one-process scale.

Each rank's shard of a split dimension must still be a whole number of the format's blocks (16 for FP8 GEMMs,
32 for MXFP8): :func:`check_split` says which layer is not, and what would work.
"""

from __future__ import annotations

from torch import nn

from lightning_moe.precision.fp8 import MX_BLOCK


def is_low_precision_linear(module: nn.Module) -> bool:
    kind = type(module).__name__
    return kind.startswith("Float8") or "MXFP8" in kind


def is_tensorwise_float8(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight, module.config.cast_config_grad_output)
    return all(cast.scaling_granularity == ScalingGranularity.TENSORWISE for cast in casts)


def float8_style(linear: nn.Module, kind: str, **layouts):
    """torchao's ``kind`` (``colwise`` / ``rowwise``) FP8 style for a tensorwise ``Float8Linear``; None otherwise
    (torch's styles split the layer)."""
    if not is_tensorwise_float8(linear):
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return (Float8ColwiseParallel if kind == "colwise" else Float8RowwiseParallel)(**layouts)


def prepare_input_style(consumers: list[nn.Module], **layouts):
    """``PrepareFloat8ModuleInput`` when every layer reading the gathered input is a tensorwise ``Float8Linear``
    (the input is then cast once, before the all-gather); None otherwise."""
    if not consumers or not all(is_tensorwise_float8(m) for m in consumers):
        return None
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    return PrepareFloat8ModuleInput(**layouts)


def check_split(name: str, linear: nn.Module, dim: str, tp: int) -> None:
    """A low-precision layer split over ``tp`` ranks along ``dim`` (``out`` or ``in``) keeps whole blocks per rank."""
    if not is_low_precision_linear(linear):
        return
    size = linear.out_features if dim == "out" else linear.in_features
    block = MX_BLOCK if "MXFP8" in type(linear).__name__ else 16
    if (size // tp) % block:
        raise ValueError(
            f"tp={tp}: {name} ({type(linear).__name__}) splits its {dim}put size {size} into shards of {size // tp}, "
            f"not a multiple of {block} (the format's block); keep it in high precision with fp8.filter_fqns: "
            f"[{name.rsplit('.', 1)[-1]!r}], or use a tp whose shards are multiples of {block}"
        )
