"""A training run's Lightning checkpoint (``.ckpt`` file or distributed directory) read back on one process, and
exported as a Hugging Face model.

Native full fine-tuning and pretraining runs hold every weight; they export through the family weight map
(with the original hub ``config.json`` when the run started from ``pretrained``). LoRA runs export merged
(their checkpoints hold adapters only), transformers-path runs through ``save_pretrained``'s layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PREFIX = "model."
# what Lightning's ModelParallelStrategy writes next to the shards: everything but weights and optimizer states
LIGHTNING_METADATA = "meta.pt"


def is_run_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_file() or (path / LIGHTNING_METADATA).is_file()


def read_run_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint (a ``.ckpt`` file or a distributed checkpoint directory) as one dict on the CPU."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_distributed_checkpoint(path)
    if path.is_file():
        # memory-mapped: tensors are paged in when used, so optimizer states an export never reads stay on disk
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    raise FileNotFoundError(f"{path}: no Lightning checkpoint (file or distributed checkpoint directory)")


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
    from lightning_moe.checkpoint.distributed import DistributedCheckpointState

    if not (path / ".metadata").is_file() or not (path / LIGHTNING_METADATA).is_file():
        raise FileNotFoundError(f"{path}: not a distributed checkpoint (needs .metadata and {LIGHTNING_METADATA})")
    checkpoint = torch.load(path / LIGHTNING_METADATA, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = DistributedCheckpointState(path)
    return checkpoint


def export_run(ckpt: str | Path, out: str | Path, *, dtype: torch.dtype | None = None, quantize: str | None = None,
               max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """The model of a ``CausalLM`` run (native, LoRA or transformers path) -> a Hugging Face directory.
    ``quantize`` and ``max_shard_bytes`` apply to native runs only (the others write as ``save_pretrained`` does)."""
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.modules.restore import run_module

    checkpoint = read_run_checkpoint(ckpt)
    module = run_module(checkpoint, ckpt)
    config = module.resolved_config()  # a model.hf with a native family trained the native decoder
    transformers_path = isinstance(config, HFModelConfig)
    if (transformers_path or module.peft is not None) and quantize is not None:
        raise ValueError(f"{ckpt}: quantize={quantize!r} applies to native full-weight runs, not LoRA or model.hf runs")
    if transformers_path:
        from lightning_moe.checkpoint.hf_model import export_hf_run

        return export_hf_run(checkpoint, out, module=module, dtype=dtype, overwrite=overwrite)
    if module.peft is not None:
        from lightning_moe.peft.run_export import export_lora_run

        return export_lora_run(ckpt, merged_out=out, dtype=dtype, overwrite=overwrite)[0]
    sharding = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return _export_native_run(ckpt, checkpoint, module, out, dtype=dtype, quantize=quantize, overwrite=overwrite,
                              **sharding)


def _export_native_run(ckpt, checkpoint: dict[str, Any], module, out, **options) -> Path:
    from lightning_moe.checkpoint.convert import export_hf_tensors
    from lightning_moe.checkpoint.source import expected_tensors, open_checkpoint

    source = open_checkpoint(Path(module.pretrained).expanduser()) if module.pretrained else None
    config = module.resolved_config()
    # names only: each tensor is read when the export writes it (a distributed checkpoint reads it from its shards)
    stored, keys = checkpoint["state_dict"], model_tensor_keys(checkpoint)
    missing = sorted(set(expected_tensors(config)) - set(keys))
    if missing:
        raise ValueError(f"{ckpt}: the checkpoint lacks {len(missing)} model tensor(s), e.g. {missing[0]!r}")
    return export_hf_tensors(
        config, lambda name: stored[keys[name]], out, hf_config=getattr(source, "hf_config", None),
        aux_dir=getattr(source, "directory", None), **options,
    )
