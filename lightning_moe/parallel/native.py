"""The native decoder as a model kind (``parallel/model_kind.py``): ``models/decoder.py``'s ``Decoder`` and its
pipeline stages. Its limits are its refusals, its block kinds' (``models/blocks.py``: split checks of every record,
read by ``ParallelDims.check_model``) and those of converted layers under tensor parallelism."""

from __future__ import annotations

from torch import nn

from lightning_moe.models.layers.moe import MoE
from lightning_moe.parallel.context import apply_context_parallel
from lightning_moe.parallel.expert import AllToAllDispatcher, apply_expert_parallel
from lightning_moe.parallel.model_kind import Refusal, refuse_unsupported
from lightning_moe.parallel.pipeline import V_SHAPED
from lightning_moe.parallel.tensor import apply_tensor_parallel, split_linears, sum_partial_gradients
from lightning_moe.precision.fp8_tensor_parallel import check_split

# without FSDP or TP both stages simply hold the one embedding module, whose gradient sums both uses
_SHARED_EMBEDDING = ("whose V schedules put the first and last stages on one rank, where the embedding they share "
                     "would be split twice")
_V_SCHEDULES = f"pp_schedule={'|'.join(V_SHAPED)}"


class NativeDecoder:
    name = "the native decoder"
    refusals = (Refusal(("pp", _V_SCHEDULES, "tie_embeddings", "fsdp"), _SHARED_EMBEDDING),
                Refusal(("pp", _V_SCHEDULES, "tie_embeddings", "tp"), _SHARED_EMBEDDING))

    def check(self, model: nn.Module, dims, options) -> None:
        refuse_unsupported(self, "the model", dims, options, model.config)
        dims.check_model(model.config)

    def apply_model_parallel(self, model: nn.Module, dims, options) -> None:
        if dims.tp > 1:
            refuse_converted_layers(model, dims.tp)
            apply_tensor_parallel(model, dims.mesh("tp"), expert_parallel=dims.ep > 1)
        if dims.ep > 1:
            apply_expert_parallel(model, dims.mesh("ep"), options.expert_dispatcher or AllToAllDispatcher)
        if dims.cp > 1:
            apply_context_parallel(model, dims.mesh("cp"), dims.mesh("cp_tp") if dims.tp > 1 else None)

    def split_experts(self, unit: nn.Module) -> list[nn.Module]:
        return [m.experts for m in unit.modules() if isinstance(m, MoE)]

    def checkpoint_outside(self, dims) -> bool:
        return dims.tp > 1

    def without_fsdp(self, model: nn.Module, dims) -> None:
        if dims.tp > 1:
            sum_partial_gradients(model)


def refuse_converted_layers(model: nn.Module, tp: int) -> None:
    """Converted layers that tensor parallelism cannot split, refused before any is split: FP8/MXFP8 layers
    whose shards would not be whole blocks of their format (LoRA and FP8 layers are otherwise split with
    styles of their own, ``parallel/lora_tensor.py`` and ``precision/fp8_tensor_parallel.py``)."""
    for name, linear, dim in split_linears(model):
        check_split(name, getattr(linear, "base_layer", linear), dim, tp)


NATIVE = NativeDecoder()
