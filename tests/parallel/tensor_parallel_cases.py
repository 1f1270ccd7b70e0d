"""Worker side of the tensor-parallel tests of converted models: LoRA-wrapped linears, stacked-expert adapters
and MTP adapters, and FP8 / MXFP8 linears, under tensor (and expert) parallelism, against one process."""

from __future__ import annotations

import torch
from parallel_cases import (
    build_dims,
    compare,
    global_batches,
    initial_state,
    tiny_config,
    train,
)

from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel import parallelize
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.peft import LoraConfig, apply_lora, is_adapter_parameter
from lightning_moe.precision import Float8Config, apply_float8


def random_adapters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Whole values for every adapter (B too, so that the first step's gradients of A are not zero)."""
    gen = torch.Generator().manual_seed(7)
    return [(name, 0.2 * torch.randn(param.shape, generator=gen)) for name, param in model.named_parameters()
            if is_adapter_parameter(name)]


def converted_model(name: str, lora: LoraConfig | None, dims=None, fp8: Float8Config | None = None,
                    **options) -> Decoder:
    """The training module's order: meta model, converters, parallelism, materialize, load."""
    config = tiny_config(name)
    with torch.device("meta"):
        model = Decoder(config)
    if fp8 is not None:
        apply_float8(model, fp8)
    if lora is not None:
        apply_lora(model, lora)
    if dims is not None:
        parallelize(model, dims, ParallelOptions(**options))
    model.to_empty(device="cpu")
    model.init_weights()
    copy_tensors_into(model, initial_state(name).items())
    if lora is not None:
        copy_tensors_into(model, random_adapters(model))
    return model


def run_lora_layout(case: str, model: str, sizes: dict[str, int], lora: dict, **options) -> list[str]:
    """LoRA (``lora``: LoraConfig fields) trained with ``sizes`` and on one process: losses, gradient norms and
    the first step's adapter gradients agree; the frozen base gets no gradient."""
    dims = build_dims(sizes)
    cfg = LoraConfig(**lora)
    batches = global_batches(tiny_config(model).vocab_size)
    expected, _ = train(converted_model(model, cfg), batches)
    got, _ = train(converted_model(model, cfg, dims, **options), batches, dims)
    problems = compare(case, expected, got)
    frozen = [name for name in got.grads if not is_adapter_parameter(name)]
    if frozen or not got.grads:
        problems.append(f"{case}: gradients of frozen weights {frozen[:3]} (or of no adapter)")
    return problems


def run_fp8_layout(case: str, model: str, sizes: dict[str, int], recipe: str, **options) -> list[str]:
    """FP8 / MXFP8 linears (emulated) trained with ``sizes`` and on one process: the scales of each GEMM are
    those of the whole tensors, so losses and gradients agree as for high-precision layers."""
    dims = build_dims(sizes)
    fp8 = Float8Config(recipe=recipe, emulate=True, min_dim=16)
    batches = global_batches(tiny_config(model).vocab_size)
    expected, _ = train(converted_model(model, None, fp8=fp8), batches)
    got, _ = train(converted_model(model, None, dims, fp8=fp8, **options), batches, dims)
    return compare(case, expected, got)


def run_compiled_layout(case: str, model: str, sizes: dict[str, int], **options) -> list[str]:
    """``run_layout`` with ``compile=True``, failing also when a compiled block fell back to the eager one (the
    CPU kernel guard warns once and keeps every block eager, which would hide a compiled block that breaks)."""
    import warnings

    from parallel_cases import run_layout

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problems = run_layout(case, model, sizes, compile=True, **options)
    fallbacks = [str(w.message) for w in caught if w.category.__name__ == "KernelCheckWarning"]
    return problems + [f"{case}: compiled blocks fell back to eager: {message}" for message in fallbacks]
