"""A transformers model (``models/hf.py``'s ``HFModel``) as a model kind (``parallel/model_kind.py``).

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
Refused before anything is built: the combinations of :data:`TRANSFORMERS`'s refusals, context parallelism of
models whose layers carry a state along the sequence (linear attention, Mamba, short convolutions), expert
parallelism of other experts modules, and plans with styles whose weights are not plain row or column slices
(packed or expert layouts).
"""

from __future__ import annotations

from torch import nn

from lightning_moe.models.hf import sequence_state_layers
from lightning_moe.models.hf_experts import standardized_experts
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.hf_context import apply_hf_context_parallel, check_hf_context_parallel
from lightning_moe.parallel.hf_expert import apply_hf_expert_parallel, check_hf_expert_parallel
from lightning_moe.parallel.model_kind import Refusal, refuse_unsupported
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.pipeline import SPLIT_BACKWARD

# transformers' tensor-parallel styles whose weights are plain row or column slices (so checkpoints load into
# them by DTensor placement) and whose gradients come out complete
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicated_with_grad_allreduce")


def check_hf_model(dims: ParallelDims, model: nn.Module, options: ParallelOptions | None = None) -> None:
    """Raise a one-line message for the parallel sizes and options the generic path does not support."""
    name = type(model.hf).__name__
    refuse_unsupported(TRANSFORMERS, name, dims, options or ParallelOptions())
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
    if dims.ep > 1 and isinstance(model.hf, nn.Module):  # a recipe check names the model only
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


class TransformersModel:
    name = "transformers (model.hf)"
    refusals = (
        Refusal(("cp", "tp"), "whose tensor-parallel plan is not combined with context parallelism there"),
        Refusal(("ep", "tp"), "whose tensor-parallel plan is not combined with expert parallelism there"),
        Refusal(("compile", "tp"), "whose tensor-parallel plan is not tested compiled"),
        Refusal(("compile", "cp"), "whose context-parallel attention is not tested compiled"),
        Refusal(("pp", "cp"), "whose pipeline stages are not split by context parallelism there"),
        Refusal(("pp", "tp"), "whose tensor-parallel plan names the whole model, not a pipeline stage"),
        Refusal(("compile", "pp"), "whose pipeline stages are not tested compiled"),
        Refusal(("pp", f"pp_schedule={'|'.join(SPLIT_BACKWARD)}"),
                "whose stages do not split their backward in two, as zero-bubble schedules need"),
    )

    def check(self, model: nn.Module, dims, options) -> None:
        check_hf_model(dims, model, options)

    def apply_model_parallel(self, model: nn.Module, dims, options) -> None:
        if dims.tp > 1:
            from transformers.distributed.tensor_parallel import apply_tensor_parallelism

            apply_tensor_parallelism(model.hf, dims.mesh("tp"), tensor_parallel_plan(model.hf, dims.tp))
            # sharding replaced the tied parameter in its first module only: tie the others to the sharded one
            model.hf.tie_weights(recompute_mapping=False)
        if dims.ep > 1:
            apply_hf_expert_parallel(model.hf, dims.mesh("ep"))
        if dims.cp > 1:
            apply_hf_context_parallel(model, dims.mesh("cp"))

    def split_experts(self, unit: nn.Module) -> list[nn.Module]:
        return [experts for _, experts in standardized_experts(unit)]

    def checkpoint_outside(self, dims) -> bool:
        return False

    def without_fsdp(self, model: nn.Module, dims) -> None:
        pass


TRANSFORMERS = TransformersModel()
