"""The model weights of a distributed (DCP) checkpoint directory, read one tensor at a time.

A training checkpoint holds the weights and two or three optimizer states per weight, split into shards
over every rank that saved it. Exporting or merging needs the weights only, and one at a time: each is read
from the byte ranges of the shards that hold its pieces, so memory holds one tensor, never the checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_moe.io.training import check_complete

# the top-level key under which Lightning saves the module's state dict
STATE_DICT = "state_dict"


class DistributedCheckpointState(Mapping[str, Any]):
    """``mapping[name]`` -> the full (unsharded) value of state-dict entry ``name`` of a DCP checkpoint."""

    def __init__(self, path: str | Path, group: str = STATE_DICT) -> None:
        self.path = Path(path)
        check_complete(self.path, trainer_state=False)  # names a missing or truncated shard before any read
        self._reader = _reader(self.path)
        prefix = group + "."
        self.group = group
        self._entries = {
            key.removeprefix(prefix): meta
            for key, meta in self._reader.read_metadata().state_dict_metadata.items()
            if key.startswith(prefix)
        }

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Any:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = self._entries[name]  # KeyError names the entry
        value = (torch.empty(meta.size, dtype=meta.properties.dtype)
                 if isinstance(meta, TensorStorageMetadata) else None)
        request = {self.group: {name: value}}
        with warnings.catch_warnings():
            # this process reads on its own, with or without a process group: that is the intent
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
            load(request, storage_reader=self._reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
        return request[self.group][name]


def _reader(path: Path):
    """torch's file-system reader, with the checkpoint's ``.metadata`` parsed once rather than once per tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def __init__(self) -> None:
            super().__init__(path)
            self._metadata = super().read_metadata()

        def read_metadata(self, *args, **kwargs):
            return self._metadata

    return Reader()
