"""A training run's Lightning checkpoint (``.ckpt`` file or distributed directory) read back on one process: its
metadata and a state dict whose tensors are read when used. Exporting a run is ``workflows.run_export``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_moe.io.distributed import DistributedCheckpointState
from lightning_moe.io.training import check_complete

PREFIX = "model."
# what Lightning's ModelParallelStrategy writes next to the shards: everything but weights and optimizer states
LIGHTNING_METADATA = "meta.pt"


def is_run_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_file() or (path / LIGHTNING_METADATA).is_file()


def read_run_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint (a ``.ckpt`` file or a distributed checkpoint directory) as one dict on the CPU; a
    missing, incomplete or truncated one is an error naming the file."""
    path = Path(path).expanduser()
    check_complete(path)
    if path.is_dir():
        return _read_distributed_checkpoint(path)
    # memory-mapped: tensors are paged in when used, so optimizer states an export never reads stay on disk
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def model_tensor_keys(checkpoint: dict[str, Any]) -> dict[str, str]:
    """The model's entries of a run checkpoint: model name -> checkpoint key (``model.`` + name)."""
    return {key.removeprefix(PREFIX): key for key in checkpoint["state_dict"] if key.startswith(PREFIX)}


def model_tensors(checkpoint: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the model's entries, each read when reached (a distributed checkpoint reads it from
    its shards then)."""
    stored = checkpoint["state_dict"]
    for name, key in model_tensor_keys(checkpoint).items():
        yield name, stored[key]


def _read_distributed_checkpoint(path: Path) -> dict[str, Any]:
    """A distributed (DCP) checkpoint directory as one dict: Lightning's ``meta.pt`` and a ``state_dict`` that
    reads each weight from the shards when asked for it (optimizer states are never read)."""
    checkpoint = torch.load(path / LIGHTNING_METADATA, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = DistributedCheckpointState(path)
    return checkpoint
