"""``parallelize_diffusion``: the package's parallelism applied to a diffusers transformer
(``models/diffusion/transformer.py``'s ``DiffusionTransformer``).

Activation checkpointing and ``torch.compile`` per transformer block, then FSDP2/HSDP ``fully_shard`` per block and
on the root (whose group keeps the input projections, timestep embedding, output norm and projection), with the
same helpers and options as the language models. Refused before anything is built: tensor, context and expert
parallelism (the dual-stream blocks have no sequence split or expert dispatcher here; Qwen-Image has no experts).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.parallel.compile import check_compile
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.fsdp import checkpoint_compile_and_shard


def check_diffusion_model(dims: ParallelDims, model: nn.Module) -> None:
    name = type(model.transformer).__name__
    for key in ("tp", "cp", "ep"):
        size = getattr(dims, key)
        if size > 1:
            raise ValueError(f"{key}={size}: {name} trains with data parallelism (FSDP2/HSDP), activation "
                             f"checkpointing and compile; use {key}=1")
    if not model.layers:
        raise ValueError(f"{name}: no repeated blocks found to shard (no _no_split_modules and no ModuleList)")


def parallelize_diffusion(
    model: nn.Module,
    dims: ParallelDims,
    *,
    activation_checkpointing: str = "none",
    activation_checkpointing_every: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    compile: bool = False,
    compile_backend: str = "inductor",
) -> nn.Module:
    """Split ``model`` (on the meta device, after converters) over the data-parallel mesh of ``dims``; the
    options mean what they mean for :func:`lightning_moe.parallel.parallelize`."""
    check_diffusion_model(dims, model)
    if compile:
        check_compile(compile_backend)

    checkpoint_compile_and_shard(
        model, dims, activation_checkpointing=activation_checkpointing,
        activation_checkpointing_every=activation_checkpointing_every, compile=compile,
        compile_backend=compile_backend, param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )
    return model
