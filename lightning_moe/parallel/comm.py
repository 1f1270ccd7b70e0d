"""Bytes the model's collectives move per optimizer step, from the model config and the parallel layout.

What one rank's collectives handle in one optimizer step of ``micro_batches`` forward + backward passes (the bytes
of each call as :mod:`lightning_moe.debug.comm_bytes` counts them: an all-gather's gathered output, a
reduce-scatter's input, an all-reduce's or all-to-all's input), by kind and mesh dimension:

- FSDP2 (``fsdp`` mesh; the experts of expert-parallel MoE layers on ``expert_fsdp``): per micro-batch and FSDP
  unit (each block, each MTP depth, the root with the embedding, final norm and output layer) one all-gather in
  forward, one more in backward for the blocks (they are resharded after forward, the root is not), and one
  reduce-scatter of the gradients (none over a mesh of one rank). A parameter's shard is ``ceil(rows / ranks)``
  rows of this rank's tensor-parallel part of it (FSDP pads the last); all-gathers move ``param_dtype``,
  reduce-scatters ``reduce_dtype``. HSDP all-reduces the reduce-scattered shards over ``dp_replicate`` once per
  step (the micro-batches before the last defer it).
- Tensor parallelism (``tp`` mesh; over this rank's context-parallel shard of the row), per micro-batch: the
  embedding's partial rows reduce-scattered to sequence shards (forward) and the gradient all-gathered back (on the
  first pipeline stage; the output layer's on the last); per linear group a record gathers (``models/blocks.py``:
  attention's q/k/v, an MLP, shared experts) the sequence all-gathered on entry and the row-wise output
  reduce-scattered, the reverse in backward, and the all-gather again where a checkpointed block recomputes its
  forward (the reduce-scatters' outputs are kept); the output layer's all-gather of the hidden states (backward: a
  reduce-scatter) and the vocabulary-parallel cross entropy's three fp32 statistics per labelled token; a
  load-balancing loss's mean. Replicated parameters' partial gradients (norms, routers, experts without expert
  parallelism) are all-reduced in the compute dtype, once per step without FSDP, every micro-batch with it.
- Context parallelism (``cp`` mesh), per micro-batch: the row's positions (int64) all-gathered once per forward;
  per attention block the keys and values (this rank's heads under TP) all-gathered (again in a recomputed
  forward), their gradients reduce-scattered.
- Pipeline parallelism (``pp`` mesh; one stage per rank: the ``gpipe`` and ``1f1b`` schedules), per micro-batch
  of the schedule: the hidden states (and the embeddings of the tokens ahead, one per MTP depth) sent to the next
  stage and their gradients back. A stage is FSDP-sharded like a model of its own parts, but the schedule keeps a
  stage's parameters unsharded from a backward until the next forward resharded them and reduces its gradients once
  per step (:func:`_stage_block_gathers`).
- Expert parallelism (``ep`` mesh), per MoE layer and micro-batch: the per-expert counts (int64), the token copies
  out and the expert outputs back, and both again in backward; a checkpointed block runs its forward again in
  backward, the copies' exchanges included (the counts are not exchanged again: ``parallel/expert.py``). Each rank
  routes its own tokens (its sequence shard under TP and CP). Token traffic is exact for balanced routing
  (``moe.force_balanced``, the benchmarks' setting): each rank then receives as many copies as it sends.

The training loop's own few-byte reductions (the step's loss and token sums over data x context parallel ranks, the
finite-gradient flag, the gradient norm) are not the model's and are left out.

Not counted yet (refused by name, :func:`check_counted`): pipeline schedules with several stages per rank, and
pipelines together with HSDP; tensor parallelism of MLA, of token-for-head trading mixers (Mamba-2, GDN, KDA) and of
MTP; context parallelism of those and of MLA; HSDP together with expert parallelism.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from lightning_moe.models.blocks import model_kinds, submodule
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.flops import mtp_depths
from lightning_moe.models.layers.moe import MoE
from lightning_moe.parallel.activation_checkpoint import checkpointed_blocks, repeated_blocks
from lightning_moe.parallel.pipeline import hold_parts, split_model
from lightning_moe.parallel.tensor import split_dimensions

COUNTED_SCHEDULES = ("gpipe", "1f1b")
CE_STATISTICS = 3  # fp32 values per labelled token all-reduced by the vocabulary-parallel cross entropy
INT64 = 8


@dataclass(frozen=True)
class StepShape:
    """One rank's micro-batches of an optimizer step and the dtypes they run in."""

    rows: int  # rows of each micro-batch on this rank
    seq_len: int  # the whole row's length (context parallelism splits it)
    micro_batches: int = 1
    dtype: torch.dtype = torch.float32  # of the parameters (and of the activations without param_dtype)
    param_dtype: torch.dtype | None = None  # FSDP's mixed-precision policy (None: the parameters' dtype)
    reduce_dtype: torch.dtype | None = torch.float32
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1
    label_tokens: int | None = None  # labelled tokens of a micro-batch on this rank (None: every token)
    pipeline_schedule: str = "1f1b"  # under pipeline parallelism (``micro_batches``: the schedule's)
    pipeline_layout: str | list[str] | None = None


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_counted(config: ModelConfig, dims, shape: StepShape) -> None:
    """Raise ``NotImplementedError`` naming the layout or block kind :func:`model_comm_bytes` does not count."""
    def refuse(what: str) -> None:
        raise NotImplementedError(f"model_comm_bytes: {what} is not counted yet")

    if dims.pp > 1 and shape.pipeline_schedule not in COUNTED_SCHEDULES:
        refuse(f"the {shape.pipeline_schedule} schedule (pp={dims.pp})")
    if dims.pp > 1 and dims.dp_replicate > 1:
        refuse(f"pp={dims.pp} with dp_replicate={dims.dp_replicate}")
    if dims.dp_replicate > 1 and dims.ep > 1:
        refuse(f"dp_replicate={dims.dp_replicate} with ep={dims.ep}")
    if config.mtp is not None and (dims.tp > 1 or dims.cp > 1):
        refuse(f"MTP with tp={dims.tp}, cp={dims.cp}")
    for kind in model_kinds(config):
        if dims.tp > 1 and (kind.tensor.local is not None or kind.tensor.trades_heads):
            refuse(f"tensor parallelism of {kind.name} blocks")
        if dims.cp > 1 and kind.context is not None and kind.name != "gqa":
            refuse(f"context parallelism of {kind.name} blocks")


def model_comm_bytes(config: ModelConfig, dims, shape: StepShape, pp_rank: int = 0) -> dict[tuple[str, str], int]:
    """``{(kind, mesh dimension): bytes}`` this rank's collectives handle per optimizer step (module docstring);
    under pipeline parallelism those of the stage of pipeline rank ``pp_rank``."""
    check_counted(config, dims, shape)
    with torch.device("meta"):
        whole = Decoder(config)
    spec = split_model(whole, dims.pp, shape.pipeline_layout)[pp_rank] if dims.pp > 1 else None
    model = whole if spec is None else _stage(whole, spec)
    first, last = spec is None or spec.embedding, spec is None or spec.output
    total: dict[tuple[str, str], int] = defaultdict(int)
    tp_split = split_dimensions(model) if dims.tp > 1 else {}
    expert_ids = {id(p) for moe in model.modules() if isinstance(moe, MoE) for p in moe.experts.parameters()}
    checkpointed = {id(block) for _, block in checkpointed_blocks(
        model, shape.activation_checkpointing, shape.activation_checkpointing_every)}

    def local_shape(param: nn.Parameter) -> list[int]:
        """This rank's part of ``param`` before FSDP: split by tensor parallelism, routed experts by EP."""
        size = list(param.shape) or [1]
        if id(param) in tp_split:
            size[tp_split[id(param)]] //= dims.tp
        if id(param) in expert_ids and dims.ep > 1:
            size[0] //= dims.ep
        return size

    _fsdp(model, dims, shape, total, local_shape, expert_ids if dims.ep > 1 else set(), pp_rank)
    if dims.pp > 1:
        _pipeline(model, dims, shape, total, pp_rank)
    if dims.tp > 1:
        _tensor(model, dims, shape, total, tp_split, expert_ids, checkpointed, first, last)
    if dims.cp > 1:
        _context(model, dims, shape, total, checkpointed)
    if dims.ep > 1:
        _experts(model, config, dims, shape, total, checkpointed)
    return dict(total)


def _fsdp(model: Decoder, dims, shape: StepShape, total: dict, local_shape, expert_ids: set[int],
          pp_rank: int) -> None:
    fsdp_ranks = dims.dp_shard * dims.cp
    if fsdp_ranks * dims.dp_replicate == 1:
        return
    m = shape.micro_batches
    # (block gathers, root gathers, reduce-scatters) per step: per micro-batch, or as a pipeline schedule runs them
    block_gathers, root_gathers, reduces = (2 * m, m, m) if dims.pp == 1 else (
        _stage_block_gathers(shape, dims.pp, pp_rank), 1, 1)
    gather = _element_size(shape.param_dtype or shape.dtype)
    reduce = _element_size(shape.reduce_dtype or shape.param_dtype or shape.dtype)

    def padded(params: list[nn.Parameter], ranks: int) -> int:
        """Elements of the whole padded tensors FSDP gathers from ``ranks`` shards."""
        return sum(ranks * math.ceil(size[0] / ranks) * math.prod(size[1:]) for size in map(local_shape, params))

    def unit(mesh: str, params: list[nn.Parameter], ranks: int, gathers: int) -> None:
        if ranks > 1:  # FSDP gathers and reduces nothing over one rank
            total[("all_gather", mesh)] += gathers * padded(params, ranks) * gather
            total[("reduce_scatter", mesh)] += reduces * padded(params, ranks) * reduce
        if dims.dp_replicate > 1:  # this rank's shard, once per step
            total[("all_reduce", "dp_replicate")] += padded(params, ranks) // ranks * reduce

    in_blocks = set()
    for _, block in repeated_blocks(model):
        params = list(block.parameters())
        in_blocks.update(id(p) for p in params)
        unit("fsdp", [p for p in params if id(p) not in expert_ids], fsdp_ranks, block_gathers)
        experts = [p for p in params if id(p) in expert_ids]
        if experts:
            unit("expert_fsdp", experts, dims.ep_shard, block_gathers)
    unit("fsdp", [p for p in model.parameters() if id(p) not in in_blocks], fsdp_ranks, root_gathers)


def _tensor(model: Decoder, dims, shape: StepShape, total: dict, tp_split: dict[int, int], expert_ids: set[int],
            checkpointed: set[int], first: bool, last: bool) -> None:
    m = shape.micro_batches
    act = _element_size(shape.param_dtype or shape.dtype)
    tokens = shape.rows * shape.seq_len // dims.cp  # the whole sequence of this context-parallel rank
    hidden = tokens * model.config.hidden_size * act
    gathers = reduces = first + last  # the embedding's and the output layer's, forward and backward
    aux_means = 0
    for _, block in repeated_blocks(model):
        groups = sum(1 for group in block.kind.tensor.gathered if submodule(block, group.owner) is not None)
        recomputed = id(block) in checkpointed
        gathers += groups * (3 if recomputed else 2)
        reduces += groups * 2
        moe = getattr(block, block.kind.attribute, None)
        if block.kind.tensor.shard_loss and isinstance(moe, MoE) and moe.cfg.aux_loss_coeff > 0:
            aux_means += 1  # a recomputed forward keeps the first mean
    total[("all_gather", "tp")] += m * gathers * hidden
    total[("reduce_scatter", "tp")] += m * reduces * hidden
    labels = (tokens if shape.label_tokens is None else shape.label_tokens) if last else 0
    total[("all_reduce", "tp")] += m * (CE_STATISTICS * labels + aux_means) * _element_size(torch.float32)
    replicated = sum(p.numel() for p in model.parameters()
                     if id(p) not in tp_split and not (dims.ep > 1 and id(p) in expert_ids))
    # in the unsharded gradients' dtype; FSDP sums them while it reduces (every micro-batch), else
    # ``tensor.sum_partial_gradients`` once per step: the rule of ``ParallelOptions.fsdp_applies``
    with_fsdp = dims.fsdp_enabled or shape.param_dtype is not None
    total[("all_reduce", "tp")] += (m if with_fsdp else 1) * replicated * act


def _context(model: Decoder, dims, shape: StepShape, total: dict, checkpointed: set[int]) -> None:
    m = shape.micro_batches
    act = _element_size(shape.param_dtype or shape.dtype)
    total[("all_gather", "cp")] += m * shape.rows * shape.seq_len * INT64  # the row's positions
    for _, block in repeated_blocks(model):
        if block.kind.context != "attend":
            continue
        attn = getattr(block, block.kind.attribute)
        heads = (attn.k_proj.out_features + attn.v_proj.out_features) // dims.tp  # this rank's under TP
        kv = shape.rows * shape.seq_len * heads * act
        total[("all_gather", "cp")] += m * (2 if id(block) in checkpointed else 1) * kv
        total[("reduce_scatter", "cp")] += m * kv


def _experts(model: Decoder, config: ModelConfig, dims, shape: StepShape, total: dict, checkpointed: set[int]) -> None:
    tokens = shape.rows * shape.seq_len // (dims.tp * dims.cp)  # each rank routes its own sequence shard
    act = _element_size(shape.param_dtype or shape.dtype)
    for _, block in repeated_blocks(model):
        for moe in (mod for mod in block.modules() if isinstance(mod, MoE)):
            copies = tokens * moe.cfg.top_k * (moe.cfg.latent_size or config.hidden_size) * act
            passes = 3 if id(block) in checkpointed else 2  # forward, (recomputed forward,) backward
            total[("all_to_all", "ep")] += shape.micro_batches * (INT64 * moe.cfg.num_experts + passes * 2 * copies)



def _stage(whole: Decoder, spec) -> Decoder:
    """The decoder pruned to what a pipeline rank holds (one stage per rank: the counted schedules)."""
    part = Decoder.__new__(Decoder)
    hold_parts(part, whole, spec.blocks, spec.embedding, spec.output)
    return part


def _stage_block_gathers(shape: StepShape, pp: int, pp_rank: int) -> int:
    """All-gathers of each block of a stage in one step. torch's schedules keep a stage's parameters unsharded
    from a backward until the next forward has run (which reshards them after) and reduce its gradients once, after
    the last backward: walk the stage's forwards and backwards in the schedule's order."""
    m = shape.micro_batches
    if shape.pipeline_schedule == "gpipe":
        order = "F" * m + "B" * m
    else:  # 1F1B: pp - rank forwards first (at most m), then one backward and one forward in turn
        warmup = min(m, pp - pp_rank)
        order = "F" * warmup + "BF" * (m - warmup) + "B" * warmup
    gathers, sharded = 0, True
    for action in order:
        gathers += sharded
        sharded = action == "F"
    return gathers


def _pipeline(model: Decoder, dims, shape: StepShape, total: dict, pp_rank: int) -> None:
    """Each micro-batch's hidden states (and the embeddings of the tokens ahead that MTP depths read) sent to the
    next stage, their gradients sent back to the previous one."""
    act = _element_size(shape.param_dtype or shape.dtype)
    depths = mtp_depths(model.config)
    # the hidden states between blocks: this rank's sequence shard under context and tensor (sequence) parallelism
    tokens = shape.rows * shape.seq_len // (dims.cp * dims.tp)
    sent = shape.micro_batches * (1 + depths) * tokens * model.config.hidden_size * act
    if pp_rank < dims.pp - 1:  # the stage's output forward, its gradient back
        total[("send", "pp")] += sent
        total[("recv", "pp")] += sent
    if pp_rank > 0:  # the stage's input, and its gradient sent back
        total[("recv", "pp")] += sent
        total[("send", "pp")] += sent
