"""``parallelize``: every parallelism applied to a meta-device decoder, in DESIGN order.

tensor (+sequence) parallel -> expert parallel -> context parallel -> activation checkpointing -> FSDP2/HSDP.
Each step lives in its own file of this package; this one only decides which apply.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.models.diffusion.transformer import DiffusionTransformer
from lightning_moe.models.hf import HFModel
from lightning_moe.parallel.compile import check_compile, checkpoint_and_compile
from lightning_moe.parallel.context import apply_context_parallel
from lightning_moe.parallel.diffusion import parallelize_diffusion
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.expert import AllToAllDispatcher, apply_expert_parallel
from lightning_moe.parallel.fsdp import apply_fsdp, fsdp_applies
from lightning_moe.parallel.hf import parallelize_hf
from lightning_moe.parallel.tensor import apply_tensor_parallel, split_linears, sum_partial_gradients
from lightning_moe.precision.fp8_tensor_parallel import check_split


def parallelize(
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
    expert_dispatcher=None,
) -> nn.Module:
    """Split ``model`` (a Decoder built on the meta device, after converters) over the meshes of ``dims``.

    Materialize it afterwards (``to_empty`` + ``init_weights`` or ``copy_tensors_into``). ``param_dtype`` /
    ``reduce_dtype`` / ``cpu_offload`` are FSDP's mixed-precision and offload policies. ``compile`` compiles every
    block with ``compile_backend`` (``parallel/compile.py``).
    ``expert_dispatcher(group, num_local_experts)`` builds the token dispatcher of expert parallelism
    (default: all-to-all).
    """
    if isinstance(model, HFModel):
        # a transformers model (the generic path) brings its own blocks: see parallel/hf.py

        return parallelize_hf(
            model, dims, activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
            compile=compile, compile_backend=compile_backend,
        )

    if isinstance(model, DiffusionTransformer):
        # a diffusers transformer (image generation): data parallelism, AC and compile, see parallel/diffusion.py

        return parallelize_diffusion(
            model, dims, activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
            compile=compile, compile_backend=compile_backend,
        )
    dims.check_model(model.config)
    if compile:
        check_compile(compile_backend)
    if dims.tp > 1:
        refuse_converted_layers(model, dims.tp)

        apply_tensor_parallel(model, dims.mesh("tp"), expert_parallel=dims.ep > 1)
    if dims.ep > 1:
        apply_expert_parallel(model, dims.mesh("ep"), expert_dispatcher or AllToAllDispatcher)
    if dims.cp > 1:
        apply_context_parallel(model, dims.mesh("cp"), dims.mesh("cp_tp") if dims.tp > 1 else None)
    checkpoint_and_compile(model, activation_checkpointing, activation_checkpointing_every, compile, compile_backend,
                           checkpoint_outside=dims.tp > 1)
    if fsdp_applies(dims, param_dtype, cpu_offload):
        apply_fsdp(
            model, dims.mesh("fsdp"), dims.mesh("expert_fsdp") if dims.ep > 1 else None,
            gradient_divide_factor=dims.dp_cp_size, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
        )
    elif dims.tp > 1:
        sum_partial_gradients(model)
    return model


def refuse_converted_layers(model: nn.Module, tp: int) -> None:
    """Converted layers that tensor parallelism cannot split, refused before any is split: FP8/MXFP8 layers
    whose shards would not be whole blocks of their format (LoRA and FP8 layers are otherwise split with
    styles of their own, ``parallel/lora_tensor.py`` and ``precision/fp8_tensor_parallel.py``)."""
    for name, linear, dim in split_linears(model):
        check_split(name, getattr(linear, "base_layer", linear), dim, tp)
