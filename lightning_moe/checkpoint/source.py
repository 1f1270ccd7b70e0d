"""Checkpoints that weights can be read from, as native tensors one at a time.

* :class:`HFCheckpoint`: a Hugging Face model directory (``config.json`` + safetensors), translated by its family.
* :class:`NativeCheckpoint`: what ``lightning-moe convert import`` writes: native tensor names,
  ``model_config.json``, and the original ``hf_config.json`` so that export reproduces the hub files.

Both validate every name and shape against the model before a single tensor is read, so a wrong
checkpoint fails at once with the offending tensor named.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from lightning_moe.io.distributed import DistributedCheckpointState
from lightning_moe.io.files import HF_CONFIG, read_json
from lightning_moe.io.quantized import hub_tensors
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.io.training import DCP_METADATA
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.families import Family, TensorMap, family_by_name, family_for_hf_config

log = logging.getLogger(__name__)

NATIVE_CONFIG = "model_config.json"
ORIGINAL_HF_CONFIG = "hf_config.json"


def expected_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Native names -> meta tensors (shape and default dtype) of the model described by ``config``."""
    with torch.device("meta"):
        return dict(Decoder(config).state_dict())


def _summarize(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


class HFCheckpoint:
    """``dequantize_dtype``: the dtype that quantized hub weights (FP8 blocks, MXFP4) are imported in."""

    def __init__(self, directory: str | Path, dequantize_dtype: torch.dtype = torch.bfloat16) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory}: not a directory")
        self.hf_config = read_json(self.directory / HF_CONFIG)
        self.family: Family = family_for_hf_config(self.hf_config)
        self.reader = hub_tensors(self.directory, self.hf_config, dequantize_dtype,
                                  lambda name: self.family.quantization_row_shards(name, self.hf_config))
        self.config = self.family.from_hf_checkpoint(self.hf_config, self.reader.keys())
        self.maps = self.family.weight_map(self.config)
        self._by_native = {name: m for m in self.maps for name in m.natives}
        self._validate()

    def _validate(self) -> None:
        reader, expected = self.reader, expected_tensors(self.config)
        consumed = {name for m in self.maps for name in m.hf}
        missing = sorted(name for name in consumed if name not in reader)
        if missing:
            raise ValueError(f"{self.directory}: missing tensor(s) {_summarize(missing)}")
        ignored = self.family.ignored_hf_tensors
        unused = [n for n in reader.keys() if n not in consumed]
        unexpected = sorted(n for n in unused if not any(p in n for p in ignored))
        if unexpected:
            raise ValueError(f"{self.directory}: unexpected tensor(s) {_summarize(unexpected)} for {self.family.name}")
        skipped = sorted(set(unused) - set(unexpected))
        if skipped:
            log.warning("%s: skipping %d hub tensor(s) %s, which %s has no module for (those matching %s)",
                        self.directory, len(skipped), _summarize(skipped, 3), self.family.name, ", ".join(ignored))
        unmapped = sorted(set(expected) - set(self._by_native))
        if unmapped:
            raise ValueError(f"family {self.family.name}: no hub tensor maps to {_summarize(unmapped)}")
        for m in self.maps:
            metas = [torch.empty(reader.shape(n), dtype=reader.dtype(n), device="meta") for n in m.hf]
            try:
                natives = m.natives_from_hf(metas)
            except RuntimeError as err:
                shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in zip(m.hf, metas))
                raise ValueError(f"{self.directory}: tensors {shapes} do not combine into {m.native} ({err})") from err
            for native, tensor in zip(m.natives, natives):
                shape, want = tuple(tensor.shape), tuple(expected[native].shape)
                if shape != want:
                    source = m.hf[0] if len(m.hf) == 1 else f"{m.hf[0]} (and {len(m.hf) - 1} more)"
                    raise ValueError(
                        f"{self.directory}: tensor {source} has shape {shape if len(m.hf) > 1 else tuple(metas[0].shape)}, "
                        f"the model expects {want} for {native}"
                    )

    def _natives_of(self, m: TensorMap) -> list[torch.Tensor]:
        return m.natives_from_hf([self.reader.get(hf) for hf in m.hf])

    def get_native(self, name: str) -> torch.Tensor:
        m = self._by_native[name]
        return self._natives_of(m)[m.natives.index(name)]

    def iter_native(self) -> Iterator[tuple[str, torch.Tensor]]:
        for m in self.maps:
            yield from zip(m.natives, self._natives_of(m))


def _imported_metadata(directory: Path) -> tuple[Path, ModelConfig, dict | None, Family]:
    """What ``convert import`` writes beside the tensors: the native config and the original hub config."""
    config = ModelConfig.load(directory / NATIVE_CONFIG)
    original = directory / ORIGINAL_HF_CONFIG
    return directory, config, read_json(original) if original.exists() else None, family_by_name(config.family)


class NativeCheckpoint:
    def __init__(self, directory: str | Path) -> None:
        self.directory, self.config, self.hf_config, self.family = _imported_metadata(Path(directory))
        self.reader = SafetensorsDir(self.directory)
        expected = expected_tensors(self.config)
        missing = sorted(set(expected) - set(self.reader.keys()))
        unexpected = sorted(set(self.reader.keys()) - set(expected))
        if missing:
            raise ValueError(f"{self.directory}: missing tensor(s) {_summarize(missing)}")
        if unexpected:
            raise ValueError(f"{self.directory}: unexpected tensor(s) {_summarize(unexpected)}")
        for name, meta in expected.items():
            if self.reader.shape(name) != tuple(meta.shape):
                raise ValueError(
                    f"{self.directory}: tensor {name} has shape {self.reader.shape(name)}, the model expects {tuple(meta.shape)}"
                )
        self.names = list(expected)

    def get_native(self, name: str) -> torch.Tensor:
        return self.reader.get(name)

    def iter_native(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.reader.get(name)


class DistributedNativeCheckpoint:
    """What the distributed import writes: native tensors in a DCP directory, read one at a time (full) or, on
    the ranks of a distributed export, each rank's part at once."""

    def __init__(self, directory: str | Path) -> None:
        self.directory, self.config, self.hf_config, self.family = _imported_metadata(Path(directory))
        self.state = DistributedCheckpointState(self.directory)
        expected = expected_tensors(self.config)
        missing = sorted(set(expected) - set(self.state))
        unexpected = sorted(set(self.state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{self.directory}: " + "; ".join(
                part for part in (missing and f"missing tensor(s) {_summarize(missing)}",
                                  unexpected and f"unexpected tensor(s) {_summarize(unexpected)}") if part))
        self.names = list(expected)

    def get_native(self, name: str) -> torch.Tensor:
        return self.state[name]

    def iter_native(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.state[name]


def is_distributed_native(path: Path) -> bool:
    return (path / NATIVE_CONFIG).exists() and (path / DCP_METADATA).exists()


def open_checkpoint(path: str | Path):
    """A native checkpoint (``model_config.json``: safetensors, or the distributed import's DCP files) or a
    Hugging Face directory (``config.json``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if (path / NATIVE_CONFIG).exists():
        return DistributedNativeCheckpoint(path) if is_distributed_native(path) else NativeCheckpoint(path)
    if (path / HF_CONFIG).exists():
        return HFCheckpoint(path)
    raise FileNotFoundError(f"{path}: missing config.json (Hugging Face) or {NATIVE_CONFIG} (imported checkpoint)")
