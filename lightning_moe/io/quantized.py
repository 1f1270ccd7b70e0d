"""Quantized hub layouts: block-scaled FP8 (DeepSeek-V3, Kimi-K2, MiMo-V2.5), MXFP4 experts (GPT-OSS) and both
at once (MiMo-V2.6: FP8 linears, MXFP4 routed experts).

Hub checkpoints of these models do not hold the weights transformers computes with but a quantized encoding:

* ``fp8-block``: ``X.weight`` in float8 e4m3 plus ``X.weight_scale_inv`` (fp32), one scale per 128x128 tile
  (edge tiles may be partial); the weight is ``fp8 * scale_inv`` tile by tile. A weight may be stored as row
  shards each on its own tile grid (MiMo-V2's fused QKV, one shard per checkpoint TP rank, each padded to whole
  tiles): the family says how many (``Family.quantization_row_shards``).
* ``mxfp4``: two e2m1 values per byte (low nibble first) and one e8m0 exponent (biased by 127) per 32 values
  along the input dimension, in one of two namings. A fused expert parameter (GPT-OSS, which transformers holds
  ``[..., in, out]``): ``X_blocks`` ``[..., out, in / 32, 16]`` and ``X_scales``. A linear's ``X.weight``
  (MiMo-V2.6's per-expert ``experts.{e}.*_proj.weight``, ``[out, in]``): ``X.weight`` ``[out, in / 2]`` (uint8) and
  ``X.weight_scale`` ``[out, in / 32]``.
* ``fp8-mxfp4``: the method of MiMo-V2.6's hub layout (``quant_method: fp8`` with ``store_dtype: mxfp4``), whose
  family names the encoding of each tensor (``Family.hub_encoding``).

:class:`DequantizedTensors` shows such a directory the way transformers holds it after dequantizing, so
family weight maps only ever see the unquantized names and layouts; :func:`quantized_hub_tensors` goes the
other way on export. Both follow transformers' own code (``integrations/finegrained_fp8.py``, ``mxfp4.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_moe.io.safetensors_io import SafetensorsDir

FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"
FP8_MXFP4 = "fp8-mxfp4"
METHODS = (FP8_BLOCK, MXFP4, FP8_MXFP4)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
DEFAULT_FP8_BLOCK = (128, 128)
FP8_SCALE_SUFFIX = "_scale_inv"

MXFP4_GROUP = 32
MXFP4_BLOCKS_SUFFIX = "_blocks"
MXFP4_SCALES_SUFFIX = "_scales"
MXFP4_WEIGHT_SCALE_SUFFIX = ".weight_scale"  # beside a uint8 ``.weight``: the row-major naming
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


def fp8_scale_rows(rows: int, block: tuple[int, int], row_shards: int = 1) -> int:
    """Tile rows of a weight of ``rows`` rows stored as ``row_shards`` shards, each on its own tile grid."""
    return row_shards * math.ceil(rows // row_shards / block[0])


def dequantize_fp8_row_shards(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                              block: tuple[int, int], row_shards: int) -> torch.Tensor:
    """:func:`dequantize_fp8_block` of each of ``row_shards`` equal row shards with its own scales."""
    scale_rows = fp8_scale_rows(weight.shape[-2], block, row_shards) // row_shards
    parts = zip(weight.chunk(row_shards, dim=-2), scale_inv.split(scale_rows, dim=-2), strict=True)
    return torch.cat([dequantize_fp8_block(w, s, dtype, block) for w, s in parts], dim=-2)


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


def quantize_fp8_row_shards(weight: torch.Tensor, block: tuple[int, int], row_shards: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_block` of each of ``row_shards`` equal row shards, concatenated."""
    if weight.shape[-2] % row_shards:
        raise ValueError(f"cannot store {weight.shape[-2]} rows as {row_shards} equal FP8 row shards")
    parts = [quantize_fp8_block(w, block) for w in weight.chunk(row_shards, dim=-2)]
    return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2)


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


def _single_grid(name: str) -> int:
    return 1


class DequantizedTensors:
    """A hub directory's tensors as transformers holds them after dequantizing (the reading interface of
    :class:`SafetensorsDir`): each FP8 weight/scale pair and each MXFP4 blocks/scales pair is one tensor.
    ``row_shards(name)``: the FP8 row shards of a weight (see the module docstring)."""

    def __init__(self, reader: SafetensorsDir, quantization: dict[str, Any], dtype: torch.dtype,
                 row_shards: Callable[[str], int] = _single_grid) -> None:
        self.reader, self.directory, self.dtype_out = reader, reader.directory, dtype
        self.block, self.row_shards = fp8_block_size(quantization), row_shards
        names = set(reader.keys())
        self._fp8: dict[str, str] = {}  # weight -> its scale
        self._mxfp4: set[str] = set()  # logical names = prefixes of _blocks/_scales pairs
        self._mxfp4_rows: set[str] = set()  # logical names = uint8 weights beside a .weight_scale
        for name in sorted(names):
            if name.endswith(MXFP4_WEIGHT_SCALE_SUFFIX):
                weight = name.removesuffix("_scale")
                if weight not in names or reader.dtype(weight) != torch.uint8:
                    raise ValueError(f"{self.directory}: MXFP4 scales {name} need a uint8 {weight} (packed e2m1)")
                self._mxfp4_rows.add(weight)
            elif name.endswith(FP8_SCALE_SUFFIX):
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
        consumed |= {w + "_scale" for w in self._mxfp4_rows}
        self._names = sorted((names - consumed) | set(self._mxfp4))

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            *lead, rows, groups, _ = self.reader.shape(name + MXFP4_BLOCKS_SUFFIX)
            return (*lead, groups * MXFP4_GROUP, rows)
        if name in self._mxfp4_rows:
            *lead, packed = self.reader.shape(name)
            return (*lead, 2 * packed)
        return self.reader.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        quantized = name in self._fp8 or name in self._mxfp4 or name in self._mxfp4_rows
        return self.dtype_out if quantized else self.reader.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._fp8:
            weight, scale = self.reader.get(name), self.reader.get(self._fp8[name])
            shards = self.row_shards(name)
            rows, cols = weight.shape[-2:]
            expected = (*weight.shape[:-2], fp8_scale_rows(rows, self.block, shards), math.ceil(cols / self.block[1]))
            if rows % shards or tuple(scale.shape) != expected:
                grids = f" as {shards} row shards, each on its own block grid" if shards > 1 else ""
                raise ValueError(
                    f"{self.directory}: {self._fp8[name]} has shape {tuple(scale.shape)}, expected {expected} for "
                    f"{tuple(weight.shape)} weights in {self.block[0]}x{self.block[1]} blocks{grids}"
                )
            return dequantize_fp8_row_shards(weight, scale, self.dtype_out, self.block, shards)
        if name in self._mxfp4_rows:
            packed, scales = self.reader.get(name), self.reader.get(name + "_scale")
            blocks = packed.reshape(*packed.shape[:-1], -1, MXFP4_GROUP // 2)
            return dequantize_mxfp4(blocks, scales, self.dtype_out)
        if name in self._mxfp4:
            blocks = self.reader.get(name + MXFP4_BLOCKS_SUFFIX)
            scales = self.reader.get(name + MXFP4_SCALES_SUFFIX)
            return dequantize_mxfp4(blocks, scales, self.dtype_out).transpose(-1, -2).contiguous()
        return self.reader.get(name)


def hub_tensors(directory: str | Path, hf_config: dict[str, Any], dequantize_dtype: torch.dtype = torch.bfloat16,
                row_shards: Callable[[str], int] = _single_grid) -> SafetensorsDir | DequantizedTensors:
    """The tensors of a hub directory, dequantized (to ``dequantize_dtype``) when config.json declares a
    quantized layout (``row_shards``: see :class:`DequantizedTensors`)."""
    reader = SafetensorsDir(directory)
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return reader
    method = quantization.get("quant_method")
    if method not in ("fp8", "mxfp4"):
        raise ValueError(f"{directory}/config.json: quantization_config.quant_method={method!r} is not supported (fp8, mxfp4)")
    return DequantizedTensors(reader, quantization, dequantize_dtype, row_shards)


# ---------------------------------------------------------------------------------------------- writing
def quantized_hub_tensors(name: str, tensor: torch.Tensor, encoding: str,
                          block: tuple[int, int] = DEFAULT_FP8_BLOCK, row_shards: int = 1
                          ) -> list[tuple[str, torch.Tensor]]:
    """The hub tensors that store ``tensor`` (transformers' layout and name) in ``encoding`` (``fp8-block``, in
    ``row_shards`` grids, or ``mxfp4``: a linear's ``.weight`` in the row-major naming, else GPT-OSS's)."""
    if encoding not in (FP8_BLOCK, MXFP4):
        raise ValueError(f"{name}: encoding {encoding!r} is not one tensor's hub encoding ({FP8_BLOCK}, {MXFP4})")
    if encoding == FP8_BLOCK:
        weight, scale_inv = quantize_fp8_row_shards(tensor, block, row_shards)
        return [(name, weight), (name + FP8_SCALE_SUFFIX, scale_inv)]
    row_major = name.endswith(".weight")
    rows_last = tensor if row_major else tensor.transpose(-1, -2)
    if rows_last.shape[-1] % MXFP4_GROUP:
        raise ValueError(
            f"cannot store {name} as MXFP4: its input dimension {rows_last.shape[-1]} is not a multiple of {MXFP4_GROUP}"
        )
    blocks, scales = quantize_mxfp4(rows_last)
    if row_major:
        return [(name, blocks.reshape(*blocks.shape[:-2], -1)), (name + "_scale", scales)]
    return [(name + MXFP4_BLOCKS_SUFFIX, blocks), (name + MXFP4_SCALES_SUFFIX, scales)]
