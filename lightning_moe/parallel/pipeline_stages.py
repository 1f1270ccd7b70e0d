"""Pipeline parallelism as the first step of the strategy's parallelization (DESIGN principle 3).

The meta-device model (a native ``Decoder``, or a transformers ``HFModel`` on the generic path) is split into
``pp x vp`` stages, this rank's stages are each parallelized like a model (``parallelize``: TP/EP/CP, activation
checkpointing and compile, FSDP with the stage as root), and the runner of those stages
(``parallel/pipeline_runner.py``) goes to the strategy. The model returned holds this rank's parts under the whole
model's names; ``held_elsewhere`` names the checkpoint tensors other ranks load. Materializing, initializing and
loading then follow as for any model (``models/build.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.models.decoder import Decoder
from lightning_moe.models.hf import HFModel
from lightning_moe.models.hf_experts import expert_load_rate
from lightning_moe.parallel.hf import TRANSFORMERS
from lightning_moe.parallel.hf_expert import check_hf_expert_parallel
from lightning_moe.parallel.model_kind import refuse_unsupported
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.parallelize import parallelize
from lightning_moe.parallel.pipeline import (
    SPLIT_BACKWARD,
    PipelinedDecoder,
    split_model,
    stage_indices,
    tied_embedding_group,
)
from lightning_moe.parallel.pipeline_hf import PipelinedHFModel, check_hf_pipeline, split_hf
from lightning_moe.parallel.pipeline_runner import PipelineRunner


def split_into_stages(model: nn.Module, dims, options: ParallelOptions,
                      device: torch.device) -> tuple[nn.Module, PipelineRunner]:
    """This rank's stages of ``model``, each parallelized, and their runner (``options.vp`` virtual stages per
    rank, ``options.pp_schedule``, ``options.pp_layout``)."""
    check_splittable(model, dims.pp)
    schedule, vp, layout = options.pp_schedule, options.vp, options.pp_layout
    local = stage_indices(dims.pp_rank, dims.pp, vp, schedule)
    split = _split_decoder if isinstance(model, Decoder) else _split_hf
    pipelined, specs = split(model, dims, options, schedule, vp, layout, local)
    for stage in pipelined.stages:
        parallelize(stage, dims, options)
        if dims.cp > 1:
            stage.context_parallel_group = dims.mesh("cp").get_group()
    runner = PipelineRunner(pipelined, dims, schedule, vp, specs, device)
    if isinstance(model, Decoder) and model.config.tie_embeddings:
        runner.tied_group = tied_embedding_group(dims, specs, schedule, vp)
    if dist.get_rank() == 0:
        print("pipeline split:\n  " + "\n  ".join(runner.split), flush=True)
    return pipelined, runner


def check_splittable(model: nn.Module, pp: int) -> None:
    if not isinstance(model, (Decoder, HFModel)):
        raise ValueError(f"pp={pp}: pipeline parallelism splits the decoders trained by CausalLM (native, or "
                         f"transformers' on the generic path); {type(model).__name__} (e.g. a vision model) is not "
                         f"split into stages yet: use pp=1")


def _split_decoder(decoder: Decoder, dims, options, schedule, vp, layout, local):
    specs = split_model(decoder, dims.pp * vp, layout)
    if schedule in SPLIT_BACKWARD:
        decoder.output_layer.repeatable_backward = True
        if options.compile:
            # the weight-gradient pass runs the compiled blocks' backward a second time: AOTAutograd must not
            # donate (reuse) the saved buffers in the first
            torch._functorch.config.donated_buffer = False
    mtp = decoder.config.mtp
    pipelined = PipelinedDecoder(decoder, specs, local, mtp.loss_scale if mtp is not None else 0.0)
    pipelined.held_elsewhere = _held_elsewhere(decoder, pipelined)
    return pipelined, specs


def _split_hf(whole: HFModel, dims, options, schedule, vp, layout, local):
    name = type(whole.hf).__name__
    rate = expert_load_rate(whole.hf)
    if rate:
        raise ValueError(f"model.bias_update_rate={rate} with pp={dims.pp}: the generic path's expert-bias updates "
                         f"count loads over all ranks, not per pipeline stage; use pp=1")
    refuse_unsupported(TRANSFORMERS, name, dims, options)  # pipelines with cp, tp, compile or zero-bubble there
    check_hf_pipeline(whole)
    if dims.ep > 1:  # on the whole model: a stage may hold no experts
        check_hf_expert_parallel(whole.hf, dims.ep)
    specs = split_hf(whole, dims.pp * vp, layout)
    pipelined = PipelinedHFModel(whole, specs, local)
    pipelined.held_elsewhere = _held_elsewhere(whole.hf, pipelined.hf)
    return pipelined, specs


def _held_elsewhere(whole: nn.Module, held: nn.Module) -> frozenset[str]:
    """Checkpoint names (a LoRA-wrapped layer's own weight is ``base_layer.weight`` in the model, plain
    ``weight`` in checkpoints) of the tensors of ``whole`` that this rank's parts ``held`` do not hold."""
    def names(module: nn.Module) -> set[str]:
        return {name.replace(".base_layer.", ".") for name in module.state_dict()}

    return frozenset(names(whole) - names(held))
