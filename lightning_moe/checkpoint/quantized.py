"""Quantized hub layouts: block-scaled FP8 (DeepSeek-V3, Kimi-K2) and MXFP4 experts (GPT-OSS).

Hub checkpoints of these models do not hold the weights transformers computes with but a quantized encoding:

* ``fp8-block``: ``X.weight`` in float8 e4m3 plus ``X.weight_scale_inv`` (fp32), one scale per 128x128 tile
  (edge tiles may be partial); the weight is ``fp8 * scale_inv`` tile by tile.
* ``mxfp4``: ``X_blocks`` (uint8, two e2m1 values per byte, low nibble first) and ``X_scales`` (uint8 e8m0
  exponents biased by 127), one exponent per 32 values along the input dimension, stored ``[..., out, in]``
  while transformers holds the tensor ``[..., in, out]``.

:class:`DequantizedTensors` shows such a directory the way transformers holds it after dequantizing, so
family weight maps only ever see the unquantized names and layouts; :func:`quantized_hub_tensors` goes the
other way on export. Both follow transformers' own code (``integrations/finegrained_fp8.py``, ``mxfp4.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.safetensors_io import SafetensorsDir

FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"
METHODS = (FP8_BLOCK, MXFP4)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
DEFAULT_FP8_BLOCK = (128, 128)
FP8_SCALE_SUFFIX = "_scale_inv"

MXFP4_GROUP = 32
MXFP4_BLOCKS_SUFFIX = "_blocks"
MXFP4_SCALES_SUFFIX = "_scales"
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX_EXPONENT = 2  # largest magnitude 6 = 1.5 * 2**2


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"quantize={method!r} is not a hub layout; choose one of {', '.join(METHODS)} or None")


# ---------------------------------------------------------------------------------------------- fp8 blocks
def _tile_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """One scale per element: each tile's scale repeated over the tile, cropped at partial edge tiles."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                         block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> torch.Tensor:
    """``weight * scale_inv`` tile by tile, computed in fp32 and rounded once to ``dtype``."""
    return (weight.float() * _tile_scales(scale_inv.float(), weight.shape, block)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 ``scale_inv``) with each tile's absolute maximum mapped to the fp8 maximum."""
    rows, cols = weight.shape[-2:]
    tiles_r, tiles_c = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.nn.functional.pad(weight.float(), (0, tiles_c * block[1] - cols, 0, tiles_r * block[0] - rows))
    tiles = padded.reshape(*weight.shape[:-2], tiles_r, block[0], tiles_c, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
    scale_inv = (1.0 / scale).float()
    scaled = weight.float() * _tile_scales(scale, weight.shape, block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


# ---------------------------------------------------------------------------------------------- mxfp4
def _e2m1_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 e2m1 codes' values: sign bit 8, magnitude index in the low 3 bits."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([magnitudes, -magnitudes])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., rows, groups, 16]`` bytes + ``[..., rows, groups]`` exponents -> ``[..., rows, groups * 32]``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up")
    values = _e2m1_values(torch.float32, blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble holds the even element
    exponents = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values[codes], exponents[..., None, None].float())
    return out.reshape(*scales.shape[:-1], -1).to(dtype)


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes of the nearest e2m1 values (ties to the even code, saturating at 6)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    size = x.abs()
    below = torch.bucketize(size, midpoints, right=False)  # ties go to the smaller magnitude
    above = torch.bucketize(size, midpoints, right=True)  # ties go to the larger one
    index = torch.where(below % 2 == 0, below, above)
    return index.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_mxfp4(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., rows, cols]`` -> (blocks, scales), one e8m0 exponent per 32 values of a row (OCP MX rounding:
    the exponent is ``floor(log2(amax)) - 2`` so the block maximum lands in e2m1's top binade)."""
    cols = tensor.shape[-1]
    groups = tensor.float().reshape(*tensor.shape[:-1], cols // MXFP4_GROUP, MXFP4_GROUP).contiguous()
    amax = groups.abs().amax(dim=-1)
    exponent = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0))) - E2M1_MAX_EXPONENT
    exponent = torch.where(amax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = _round_to_e2m1(torch.ldexp(groups, -exponent[..., None]))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8)


# ---------------------------------------------------------------------------------------------- reading
def fp8_block_size(quantization: dict[str, Any]) -> tuple[int, int]:
    block = quantization.get("weight_block_size") or DEFAULT_FP8_BLOCK
    return int(block[0]), int(block[1])


class DequantizedTensors:
    """A hub directory's tensors as transformers holds them after dequantizing (the reading interface of
    :class:`SafetensorsDir`): each FP8 weight/scale pair and each MXFP4 blocks/scales pair is one tensor."""

    def __init__(self, reader: SafetensorsDir, quantization: dict[str, Any], dtype: torch.dtype) -> None:
        self.reader, self.directory, self.dtype_out = reader, reader.directory, dtype
        self.block = fp8_block_size(quantization)
        names = set(reader.keys())
        self._fp8: dict[str, str] = {}  # weight -> its scale
        self._mxfp4: set[str] = set()  # logical names = prefixes of _blocks/_scales pairs
        for name in sorted(names):
            if name.endswith(FP8_SCALE_SUFFIX):
                weight = name.removesuffix(FP8_SCALE_SUFFIX)
                if weight not in names:
                    raise ValueError(f"{self.directory}: scale {name} has no weight {weight}")
                self._fp8[weight] = name
            elif name.endswith(MXFP4_BLOCKS_SUFFIX):
                base = name.removesuffix(MXFP4_BLOCKS_SUFFIX)
                if base + MXFP4_SCALES_SUFFIX not in names:
                    raise ValueError(f"{self.directory}: MXFP4 tensor {name} has no {base}{MXFP4_SCALES_SUFFIX}")
                self._mxfp4.add(base)
            elif name.endswith(MXFP4_SCALES_SUFFIX) and name.removesuffix(MXFP4_SCALES_SUFFIX) + MXFP4_BLOCKS_SUFFIX not in names:
                raise ValueError(f"{self.directory}: MXFP4 scales {name} have no {name.removesuffix(MXFP4_SCALES_SUFFIX)}_blocks")
            elif "activation_scale" in name or name.endswith("input_scale"):
                raise ValueError(f"{self.directory}: {name}: static activation scales are not supported (dynamic only)")
        consumed = set(self._fp8.values()) | {b + s for b in self._mxfp4 for s in (MXFP4_BLOCKS_SUFFIX, MXFP4_SCALES_SUFFIX)}
        self._names = sorted((names - consumed) | set(self._mxfp4))

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            *lead, rows, groups, _ = self.reader.shape(name + MXFP4_BLOCKS_SUFFIX)
            return (*lead, groups * MXFP4_GROUP, rows)
        return self.reader.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_out if name in self._fp8 or name in self._mxfp4 else self.reader.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._fp8:
            weight, scale = self.reader.get(name), self.reader.get(self._fp8[name])
            expected = tuple(weight.shape[:-2]) + tuple(math.ceil(d / b) for d, b in zip(weight.shape[-2:], self.block))
            if tuple(scale.shape) != expected:
                raise ValueError(
                    f"{self.directory}: {self._fp8[name]} has shape {tuple(scale.shape)}, expected {expected} for "
                    f"{tuple(weight.shape)} weights in {self.block[0]}x{self.block[1]} blocks"
                )
            return dequantize_fp8_block(weight, scale, self.dtype_out, self.block)
        if name in self._mxfp4:
            blocks = self.reader.get(name + MXFP4_BLOCKS_SUFFIX)
            scales = self.reader.get(name + MXFP4_SCALES_SUFFIX)
            return dequantize_mxfp4(blocks, scales, self.dtype_out).transpose(-1, -2).contiguous()
        return self.reader.get(name)


def hub_tensors(directory: str | Path, hf_config: dict[str, Any],
                dequantize_dtype: torch.dtype = torch.bfloat16) -> SafetensorsDir | DequantizedTensors:
    """The tensors of a hub directory, dequantized (to ``dequantize_dtype``) when config.json declares a
    quantized layout."""
    reader = SafetensorsDir(directory)
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return reader
    method = quantization.get("quant_method")
    if method not in ("fp8", "mxfp4"):
        raise ValueError(f"{directory}/config.json: quantization_config.quant_method={method!r} is not supported (fp8, mxfp4)")
    return DequantizedTensors(reader, quantization, dequantize_dtype)


# ---------------------------------------------------------------------------------------------- writing
def quantized_hub_tensors(name: str, tensor: torch.Tensor, method: str,
                          block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> list[tuple[str, torch.Tensor]]:
    """The hub tensors that store ``tensor`` (transformers' layout and name) in layout ``method``."""
    check_method(method)
    if method == FP8_BLOCK:
        weight, scale_inv = quantize_fp8_block(tensor, block)
        return [(name, weight), (name + FP8_SCALE_SUFFIX, scale_inv)]
    rows_last = tensor.transpose(-1, -2)
    if rows_last.shape[-1] % MXFP4_GROUP:
        raise ValueError(
            f"cannot store {name} as MXFP4: its input dimension {rows_last.shape[-1]} is not a multiple of {MXFP4_GROUP}"
        )
    blocks, scales = quantize_mxfp4(rows_last)
    return [(name + MXFP4_BLOCKS_SUFFIX, blocks), (name + MXFP4_SCALES_SUFFIX, scales)]
