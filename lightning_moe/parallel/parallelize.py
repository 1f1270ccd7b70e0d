"""``parallelize``: every parallelism applied to a meta-device model, in DESIGN order.

check -> tensor (+sequence) parallel -> expert parallel -> context parallel -> activation checkpointing and
compile per block -> FSDP2/HSDP. The model is known only through its kind (``parallel/model_kind.py``: the
native decoder, a transformers model, a diffusers transformer); each parallelism lives in its own file of this
package.
"""

from __future__ import annotations

from torch import nn

from lightning_moe.models.diffusion.transformer import DiffusionTransformer
from lightning_moe.models.hf import HFModel
from lightning_moe.parallel.compile import check_compile, checkpoint_and_compile
from lightning_moe.parallel.diffusion import DIFFUSERS
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.fsdp import apply_fsdp
from lightning_moe.parallel.hf import TRANSFORMERS
from lightning_moe.parallel.model_kind import ModelKind
from lightning_moe.parallel.native import NATIVE
from lightning_moe.parallel.options import ParallelOptions

MODEL_KINDS: tuple[ModelKind, ...] = (NATIVE, TRANSFORMERS, DIFFUSERS)


def model_kind(model: nn.Module) -> ModelKind:
    """The kind of ``model``: a transformers or diffusers wrapper, else the native decoder (or a stage of it)."""
    if isinstance(model, HFModel):
        return TRANSFORMERS
    if isinstance(model, DiffusionTransformer):
        return DIFFUSERS
    return NATIVE


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None) -> nn.Module:
    """Split ``model`` (built on the meta device, after converters) over the meshes of ``dims``; materialize it
    afterwards (``to_empty`` + initialization, or a checkpoint's tensors)."""
    options = options or ParallelOptions()
    kind = model_kind(model)
    kind.check(model, dims, options)
    if options.compile:
        check_compile(options.compile_backend)
    kind.apply_model_parallel(model, dims, options)
    checkpoint_and_compile(model, options.activation_checkpointing, options.activation_checkpointing_every,
                           options.compile, options.compile_backend, checkpoint_outside=kind.checkpoint_outside(dims))
    if options.fsdp_applies(dims):
        apply_fsdp(
            model, dims.mesh("fsdp"), dims.mesh("expert_fsdp") if dims.ep > 1 else None, kind.split_experts,
            gradient_divide_factor=dims.dp_cp_size, param_dtype=options.param_dtype,
            reduce_dtype=options.reduce_dtype, cpu_offload=options.cpu_offload,
            reshard_after_forward=options.reshard_after_forward,
        )
    else:
        kind.without_fsdp(model, dims)
    return model
