"""Import a Hugging Face checkpoint, export one, and verify two of them tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.hf_model import export_hf_model
from lightning_moe.checkpoint.source import (
    HF_CONFIG,
    NATIVE_CONFIG,
    ORIGINAL_HF_CONFIG,
    HFCheckpoint,
    open_checkpoint,
)
from lightning_moe.io.atomic import atomic_directory
from lightning_moe.io.files import copy_aux_files
from lightning_moe.io.quantized import check_method, fp8_block_size, quantized_hub_tensors
from lightning_moe.io.safetensors_io import SafetensorsDir, ShardedWriter
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.families import Family, family_by_name
from lightning_moe.models.hf import HFModel
from lightning_moe.models.hf_form import hub_tensor_groups

DEFAULT_SHARD_BYTES = 5 * 2**30


def import_hf_checkpoint(hf_dir: str | Path, out: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                         overwrite: bool = False, dequantize_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Hugging Face directory -> native checkpoint directory (native names, original dtypes, streamed;
    quantized hub weights are dequantized to ``dequantize_dtype``)."""
    source = HFCheckpoint(hf_dir, dequantize_dtype)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, tensor in source.iter_native():
            writer.add(name, tensor)
        writer.finish()
        source.config.save(tmp / NATIVE_CONFIG)
        (tmp / ORIGINAL_HF_CONFIG).write_text(json.dumps(source.hf_config, indent=2) + "\n")
        copy_aux_files(source.directory, tmp)
    return Path(out)


def export_hf_tensors(
    config: ModelConfig,
    native: Callable[[str], torch.Tensor],
    out: str | Path,
    *,
    hf_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    aux_dir: Path | None = None,
    overwrite: bool = False,
    quantize: str | None = None,
) -> Path:
    """Write a transformers-loadable directory from native tensors fetched one at a time by ``native(name)``.

    ``quantize`` (``"fp8-block"`` or ``"mxfp4"``) writes the tensors the family's hub checkpoints store
    quantized in that layout, with the matching ``quantization_config``; None writes them unquantized.
    """
    family = family_by_name(config.family)
    hf = export_hf_config(family, config, hf_config, dtype, quantize)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for names, tensors in hub_tensor_groups(config, native, dtype):
            write_hub_tensors(writer, family, names, tensors, hf, quantize)
        writer.finish()
        (tmp / HF_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
        if aux_dir is not None:
            copy_aux_files(aux_dir, tmp)
    return Path(out)


def export_hf_config(family: Family, config: ModelConfig, hf_config: dict[str, Any] | None, dtype: torch.dtype | None,
                     quantize: str | None) -> dict[str, Any]:
    """The config.json of an export: the source's (or the family's translation), with the export's dtype and
    ``quantization_config``."""
    hf = dict(hf_config) if hf_config is not None else family.to_hf_config(config)
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
        hf.pop("torch_dtype", None)
    original_quantization = hf.pop("quantization_config", None)
    if quantize is not None:
        hf["quantization_config"] = hub_quantization_config(family, quantize, original_quantization)
    return hf


def write_hub_tensors(writer: ShardedWriter, family: Family, names: Sequence[str], tensors: Sequence[torch.Tensor],
                      hf: dict[str, Any], quantize: str | None) -> None:
    """Hub tensors ``names`` (of one weight map) into ``writer``, quantized where the layout ``quantize`` stores
    them quantized (block size from ``hf``'s ``quantization_config``)."""
    block = fp8_block_size(hf.get("quantization_config") or {})
    for name, part in zip(names, tensors, strict=True):
        encoding = None if quantize is None else family.hub_encoding(name, quantize)
        if encoding is not None:
            shards = family.quantization_row_shards(name, hf)
            for quantized_name, quantized in quantized_hub_tensors(name, part, encoding, block, shards):
                writer.add(quantized_name, quantized)
        else:
            writer.add(name, part)


def export_hf_checkpoint(ckpt: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                         quantize: str | None = None) -> Path:
    """Native (or Hugging Face) checkpoint directory -> Hugging Face directory (``quantize``: see
    :func:`export_hf_tensors`)."""
    source = open_checkpoint(ckpt)
    return export_hf_tensors(
        source.config, source.get_native, out, hf_config=source.hf_config, dtype=dtype, max_shard_bytes=max_shard_bytes,
        aux_dir=source.directory, overwrite=overwrite, quantize=quantize,
    )


def hub_quantization_config(family: Family, method: str, original: dict[str, Any] | None) -> dict[str, Any]:
    """The ``quantization_config`` to write: the source checkpoint's when it used this layout, else the family's."""
    check_method(method)
    default = family.hf_quantization_config(method)
    if default is None:
        raise ValueError(f"quantize={method!r}: {family.name} checkpoints have no such hub layout")
    same = ("quant_method", "store_dtype")
    if original is not None and all(original.get(key) == default.get(key) for key in same):
        return dict(original)
    return default


def export_model(model: torch.nn.Module, out: str | Path, *, hf_config: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None, aux_dir: Path | None = None, overwrite: bool = False,
                 quantize: str | None = None) -> Path:
    """An in-memory (unsharded) native model -> Hugging Face directory. A transformers model of the generic path
    (``HFModel``, possibly sharded) is written as ``save_pretrained`` writes it (``quantize`` does not apply)."""
    if isinstance(model, HFModel):
        if quantize is not None or hf_config is not None:
            raise ValueError("export of a transformers (model.hf) model takes neither quantize nor hf_config")
        return export_hf_model(model.hf, out, dtype=dtype, aux_dir=aux_dir or model.model_dir, overwrite=overwrite)
    state = model.state_dict()
    return export_hf_tensors(model.config, state.__getitem__, out, hf_config=hf_config, dtype=dtype,
                             aux_dir=aux_dir, overwrite=overwrite, quantize=quantize)


@dataclass
class VerifyReport:
    tensors: int = 0
    parameters: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        head = f"{self.tensors:,} tensors, {self.parameters:,} parameters"
        if self.ok:
            return f"{head}: all match in name, shape, dtype and value"
        return f"{head}: {len(self.mismatches)} mismatch(es)\n" + "\n".join(f"  {m}" for m in self.mismatches)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # flattened first: a 0-dim tensor cannot be viewed as bytes
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def verify_hf_checkpoints(reference: str | Path, candidate: str | Path) -> VerifyReport:
    """Compare two safetensors directories: names, shapes, dtypes and bitwise values."""
    ref, cand = SafetensorsDir(reference), SafetensorsDir(candidate)
    report = VerifyReport()
    ref_names, cand_names = set(ref.keys()), set(cand.keys())
    report.mismatches += [f"{n}: missing from candidate" for n in sorted(ref_names - cand_names)]
    report.mismatches += [f"{n}: not in reference" for n in sorted(cand_names - ref_names)]
    for name in sorted(ref_names & cand_names):
        report.tensors += 1
        shape, dtype = ref.shape(name), ref.dtype(name)
        report.parameters += int(torch.Size(shape).numel())
        if cand.shape(name) != shape:
            report.mismatches.append(f"{name}: shape {shape} != {cand.shape(name)}")
        elif cand.dtype(name) != dtype:
            report.mismatches.append(f"{name}: dtype {dtype} != {cand.dtype(name)}")
        else:
            a, b = ref.get(name), cand.get(name)
            if not torch.equal(_bits(a), _bits(b)):
                diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
                report.mismatches.append(f"{name}: values differ (max abs diff {diff})")
    return report
