"""Export of the generic transformers path: a (sharded, possibly LoRA-adapted) transformers model written as
``save_pretrained`` writes the same weights (hub names, transformers' reverse conversion), gathered from the
shards with the adapters folded in. Loading is ``models.hf_weights``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.io.atomic import atomic_directory
from lightning_moe.io.files import copy_aux_files
from lightning_moe.peft.merge import merged_state_dict


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors of a (possibly FSDP/TP-sharded) model with adapters folded in; collective: call on every
    rank. transformers' own names (no ``base_layer``, no adapters)."""
    return {name: tensor.detach().cpu() for name, tensor in merged_state_dict(model).items()}


def export_hf_model(hf_model: nn.Module, out: str | Path, *, dtype: torch.dtype | None = None,
                    aux_dir: str | Path | None = None, overwrite: bool = False,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write ``hf_model`` (a transformers model, possibly sharded or with LoRA adapters) as a directory that
    ``from_pretrained`` loads: the files ``save_pretrained`` writes for the same weights. Collective under
    torch.distributed (every rank gathers, rank 0 writes); written completely or not at all."""
    state = gathered_state_dict(hf_model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return Path(out)
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    config = copy.deepcopy(hf_model.config)
    if dtype is not None:
        config.dtype = dtype
    try:
        with atomic_directory(out, overwrite=overwrite) as tmp:
            if aux_dir is not None:
                copy_aux_files(Path(aux_dir), tmp)
            original, hf_model.config = hf_model.config, config
            try:
                hf_model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
            finally:
                hf_model.config = original
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    return Path(out)
