"""``parallelize_hf``: the package's parallelism applied to a transformers model (``models/hf.py``'s ``HFModel``).

The same helpers as for the native decoder, driven by the model's repeated blocks (``HFModel.layers``: decoder
layers, and vision blocks of vision-language models): activation checkpointing per block, then FSDP2/HSDP
``fully_shard`` per block and on the root, whose group keeps the embeddings, final norm, output layer and
whatever is not a block (e.g. a vision projector). Context and expert parallelism need native modules (the
load-balanced sequence split, the expert dispatcher); tensor parallelism of transformers models is not
wired up: all three are refused before anything is built.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_moe.parallel.dims import ParallelDims


def check_hf_model(dims: ParallelDims, model: nn.Module) -> None:
    """Raise a one-line message for the parallel sizes the generic path does not support."""
    name = type(model.hf).__name__
    for key in ("tp", "cp", "ep"):
        size = getattr(dims, key)
        if size > 1:
            raise ValueError(f"{key}={size}: {name} runs through transformers (model.hf), where only data parallelism "
                             f"(FSDP2/HSDP) and activation checkpointing apply; use {key}=1, or a natively "
                             f"supported architecture")
    if not model.layers:
        raise ValueError(f"{name}: no repeated blocks found to shard (no _no_split_modules and no ModuleList)")


def parallelize_hf(
    model: nn.Module,
    dims: ParallelDims,
    *,
    activation_checkpointing: str = "none",
    activation_checkpointing_every: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Split ``model`` (an ``HFModel`` on the meta device, after converters) over the data-parallel meshes of
    ``dims``; the options mean what they mean for :func:`lightning_moe.parallel.parallelize`."""
    check_hf_model(dims, model)
    apply_activation_checkpointing(model, activation_checkpointing, activation_checkpointing_every)
    if dims.fsdp_enabled or param_dtype is not None or cpu_offload:
        from lightning_moe.parallel.fsdp import apply_fsdp

        apply_fsdp(
            model, dims.mesh("fsdp"), gradient_divide_factor=dims.dp_cp_size, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
        )
    return model
