"""``parallelize_hf``: the package's parallelism applied to a transformers model (``models/hf.py``'s ``HFModel``).

Tensor parallelism follows the model's own ``tp_plan`` with transformers' DTensor styles (column-wise and
row-wise linears, vocabulary-split embedding and output layer, per-head norms whose gradients are summed);
the output layer's cross entropy stays fused and becomes vocabulary-parallel. Then the same helpers as for the
native decoder, driven by the model's repeated blocks (``HFModel.layers``: decoder layers, and vision blocks of
vision-language models): activation checkpointing per block, and FSDP2/HSDP ``fully_shard`` per block and on
the root, whose group keeps the embeddings, final norm, output layer and whatever is not a block (e.g. a vision
projector); under tensor parallelism FSDP shards the tensor-parallel DTensors over the data-parallel ranks
(2-D). Expert parallelism splits transformers' standardized experts modules (``parallel/hf_expert.py``).
Context parallelism switches the model's attention to the package's context-parallel attention
(``parallel/hf_context.py``); the strategy splits the batch along the sequence as for native decoders.
Refused before anything is built: context parallelism of models whose layers carry a state along the sequence
(linear attention, Mamba, short convolutions) or together with tensor parallelism, expert parallelism of other
experts modules or together with tensor parallelism, and plans with styles whose weights are not plain row or
column slices (packed or expert layouts).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.models.hf import sequence_state_layers
from lightning_moe.parallel.compile import check_compile
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.hf_context import apply_hf_context_parallel, check_hf_context_parallel
from lightning_moe.parallel.hf_expert import apply_hf_expert_parallel, check_hf_expert_parallel

# transformers' tensor-parallel styles whose weights are plain row or column slices (so checkpoints load into
# them by DTensor placement) and whose gradients come out complete
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicated_with_grad_allreduce")


def check_hf_model(dims: ParallelDims, model: nn.Module) -> None:
    """Raise a one-line message for the parallel sizes the generic path does not support."""
    name = type(model.hf).__name__
    if dims.cp > 1 and isinstance(model.hf, nn.Module):  # a recipe check names the model only
        check_hf_context_parallel(model.hf, dims.cp)
        state = sequence_state_layers(model.hf)
        if state:
            raise ValueError(f"cp={dims.cp}: {name} runs through transformers (model.hf), where context parallelism "
                             f"splits attention only ({', '.join(state)} carry a state along the sequence, which it "
                             f"does not hand from rank to rank); use cp=1, or a natively supported architecture")
        if model.packing_limitation is not None:  # the same mixing along the sequence that packing cannot restart
            raise ValueError(f"cp={dims.cp}: {name} runs through transformers (model.hf), where context parallelism "
                             f"splits attention only, and {model.packing_limitation}; use cp=1")
    if dims.cp > 1 and dims.tp > 1:
        raise ValueError(f"cp={dims.cp} with tp={dims.tp}: {name} runs through transformers (model.hf), whose "
                         f"tensor-parallel plan is not combined with context parallelism there; use tp=1 or cp=1")
    if dims.ep > 1:
        if dims.tp > 1:
            raise ValueError(f"ep={dims.ep} with tp={dims.tp}: {name} runs through transformers (model.hf), whose "
                             f"tensor-parallel plan is not combined with expert parallelism there; use tp=1 or ep=1")
        if isinstance(model.hf, nn.Module):  # a recipe check names the model only
            check_hf_expert_parallel(model.hf, dims.ep)
    if dims.tp > 1:
        tensor_parallel_plan(model.hf, dims.tp)
    if not model.layers:
        raise ValueError(f"{name}: no repeated blocks found to shard (no _no_split_modules and no ModuleList)")


def tensor_parallel_plan(hf_model: nn.Module, tp: int) -> dict[str, str]:
    """The model's ``tp_plan`` with layer numbers filled in, one entry per module and per parameter it shards."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    name = type(hf_model).__name__
    plan = dict(getattr(hf_model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"tp={tp}: {name} has no tensor-parallel plan (tp_plan); use tp=1")
    unsupported = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unsupported:
        raise ValueError(f"tp={tp}: {name}'s tp_plan uses {', '.join(unsupported)}, which the generic path does "
                         f"not split (supported: {', '.join(TP_STYLES)}); use tp=1")
    text = hf_model.config.get_text_config()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, key, None)
        if heads is not None and heads % tp:
            raise ValueError(f"tp={tp} does not divide {key}={heads} of {name}; use a tp that divides it")
    # a tied parameter (output layer = input embedding) is sharded once, under its first name; both styles split
    # the vocabulary rows, and the other module still gets its forward
    owned = {name for name, _ in hf_model.named_parameters()}
    expanded = {}
    for module_name, module in hf_model.named_modules():
        style = plan.get(replace_layer_number_by_wildcard(module_name))
        if style is None:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            if f"{module_name}.{param_name}" in owned:
                expanded[f"{module_name}.{param_name}"] = style
        expanded[module_name] = style
    return expanded


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
    compile: bool = False,
    compile_backend: str = "inductor",
) -> nn.Module:
    """Split ``model`` (an ``HFModel`` on the meta device, after converters) over the meshes of ``dims``; the
    options mean what they mean for :func:`lightning_moe.parallel.parallelize`."""
    check_hf_model(dims, model)
    if compile:
        check_compile(compile_backend)
        if dims.tp > 1:
            raise ValueError(f"compile=True with tp={dims.tp}: {type(model.hf).__name__} runs through transformers, "
                             f"whose tensor-parallel plan is not tested compiled; use compile=False, or tp=1")
        if dims.cp > 1:
            raise ValueError(f"compile=True with cp={dims.cp}: {type(model.hf).__name__} runs through transformers, "
                             f"whose context-parallel attention is not tested compiled; use compile=False, or cp=1")
    if dims.tp > 1:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model.hf, dims.mesh("tp"), tensor_parallel_plan(model.hf, dims.tp))
        # sharding replaced the tied parameter in its first module only: tie the others to the sharded one again
        model.hf.tie_weights(recompute_mapping=False)
    if dims.ep > 1:
        apply_hf_expert_parallel(model.hf, dims.mesh("ep"))
    if dims.cp > 1:
        apply_hf_context_parallel(model, dims.mesh("cp"))
    from lightning_moe.parallel.fsdp import checkpoint_compile_and_shard

    checkpoint_compile_and_shard(
        model, dims, activation_checkpointing=activation_checkpointing,
        activation_checkpointing_every=activation_checkpointing_every, compile=compile,
        compile_backend=compile_backend, param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )
    return model
