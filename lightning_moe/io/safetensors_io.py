"""Sharded safetensors directories: lazy per-tensor reads, and a writer that flushes shard by shard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_moe.dtypes import SAFETENSORS_DTYPES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"



class SafetensorsDir:
    """Tensor names -> files of a (sharded) safetensors checkpoint; tensors are read one at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        index = self.directory / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{index}: not a safetensors index ({err})") from err
            self.files = {name: self.directory / file for name, file in weight_map.items()}
            for file in set(self.files.values()):
                if not file.exists():
                    raise FileNotFoundError(f"{index} names shard {file.name}, which does not exist")
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.directory}: no *.safetensors files and no {INDEX_NAME}")
            self.files = {}
            for shard in shards:
                for name in self._open(shard).keys():
                    self.files[name] = shard

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"{file}: unreadable safetensors file ({err})") from err
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._open(self.files[name]).get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._open(self.files[name]).get_tensor(name)
        except Exception as err:
            raise ValueError(f"{self.files[name]}: cannot read tensor {name!r} ({err})") from err

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of a tensor, reading only their bytes."""
        try:
            return self._open(self.files[name]).get_slice(name)[start:stop]
        except Exception as err:
            raise ValueError(f"{self.files[name]}: cannot read rows {start}:{stop} of tensor {name!r} ({err})") from err

    def close(self) -> None:
        self._handles.clear()


class ShardedWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes``."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = 5 * 2**30, metadata: dict | None = None,
                 temp_prefix: str = "") -> None:
        self.directory = Path(directory)
        self.temp_prefix = temp_prefix  # several writers (ranks) filling one directory name their shards apart
        self.max_shard_bytes = max_shard_bytes
        self.metadata = metadata or {"format": "pt"}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()  # every tensor added so far (a hub checkpoint may hold 100k+)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.directory / f".{self.temp_prefix}shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata=self.metadata)
        self._shards.append((path.name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str]]]:
        """Write what is pending; the shards so far as (temporary file name, tensor names)."""
        if self._pending:
            self._flush()
        return list(self._shards)

    def finish(self) -> list[str]:
        """Name the shards ``model-0000k-of-0000n`` now that n is known, and write the index."""
        if self._pending or not self._shards:
            self._flush()
        return name_shards(self.directory, self._shards, self.total_bytes)


def final_shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def name_shards(directory: Path, shards: list[tuple[str, list[str]]], total_bytes: int,
                rename: bool = True) -> list[str]:
    """Rename temporary shards to ``model-0000k-of-0000n`` in order and write the index (``rename=False``: the
    shards were renamed by the processes that wrote them; only the index is written)."""
    names = final_shard_names(len(shards))
    weight_map = {}
    for (temp, tensors), name in zip(shards, names):
        if rename:
            os.replace(directory / temp, directory / name)
        weight_map.update({t: name for t in tensors})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names
