"""Per-rank training memory of a layout, before anything is allocated.

Components of one rank (bytes), in the order a step fills them:

- parameters: dense tensors sharded by FSDP over ``dp_shard x cp`` and, where tensor parallelism splits them
  (``parallel/tensor.py``'s ``split_parameters``: what the block records' TP plans split), by ``tp``;
  routed experts split over ``ep`` and sharded over the rest of the expert region (``dp_shard x cp x tp /
  ep``), or without expert parallelism sharded like dense parameters and never split by ``tp``; pipeline stages hold only their blocks. Stored dtype from the trainer's precision (``bf16-true``:
  bf16, else fp32 master weights), LoRA's ``base_dtype`` for frozen bases.
- gradients and optimizer states: trainable parameters only, sharded like them (but for the embedding's
  gradient, whole under tensor parallelism without FSDP: ``parallel/tensor.py``'s ``whole_gradients``); AdamW
  keeps two moments in the parameter's dtype.
- FSDP working set: the unsharded parameters of the two largest FSDP units in the compute dtype (the one
  running and the one prefetched) and the unsharded gradients of the largest one in the reduce dtype.
- activations: what autograd saves during a micro-batch's forward, measured by
  :func:`~lightning_moe.estimate.probe.saved_activations` on the rank's tokens (``micro_batch x seq / cp``,
  then ``/ tp`` for tensor and sequence parallelism), with activation checkpointing applied per block
  (a checkpointed block keeps its input and is recomputed, one at a time, during backward). Pipeline ranks
  hold the blocks of the strategy's own split (``parallel/pipeline.py``), and rank ``r`` of a 1F1B-like
  schedule holds ``pp - r`` micro-batches in flight (GPipe would hold all of them).
- loss buffers: the fused output-layer loss's gradients, computed during forward (:func:`output_loss_bytes`).

FP8 weight casts and LoRA adapters are in the model the probe runs, so they appear where they are saved.
Not counted: CUDA context and NCCL buffers (~1-3 GiB on a GPU), allocator fragmentation, data-loader
workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_moe.dtypes import dtype_option
from lightning_moe.estimate.probe import default_dtype, saved_activations
from lightning_moe.estimate.recipe import RecipeLayout
from lightning_moe.models.blocks import submodule
from lightning_moe.models.converters import apply_converters
from lightning_moe.models.decoder import Block, Decoder
from lightning_moe.models.fake_tensors import fake_model
from lightning_moe.models.flops import mtp_depths
from lightning_moe.parallel.activation_checkpoint import checkpointed_blocks, repeated_blocks
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.pipeline import check_schedule, default_schedule, split_model, stage_indices
from lightning_moe.parallel.tensor import split_parameters, whole_gradients

GIB = 1024**3
COMPONENTS = ("parameters", "gradients", "optimizer states", "FSDP working set", "activations", "loss buffers")
EMBEDDING, OUTPUT = "embedding", "final norm and output layer"  # FSDP units outside the repeated blocks


@dataclass
class RankMemory:
    """One kind of rank (every rank alike, or a pipeline stage) and its components in bytes."""

    kind: str
    components: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.components.values())


def stored_dtype(precision: str) -> torch.dtype:
    """Parameter dtype under Lightning's precision string: ``*-true`` stores in that dtype, mixed keeps fp32."""
    if precision.startswith("bf16-true"):
        return torch.bfloat16
    if precision.startswith("16-true"):
        return torch.float16
    return torch.float32


def build_fake_decoder(layout: RecipeLayout, dtype: torch.dtype):
    def build() -> nn.Module:
        with default_dtype(dtype):
            model = Decoder(layout.model)
        apply_converters(model, layout.fp8, layout.peft, layout.freeze)
        return model

    return fake_model(build)


def _expert_params(model: nn.Module) -> set[int]:
    """The routed experts' parameters, as their block records name them."""
    blocks = [m for m in model.modules() if isinstance(m, Block) and m.kind.experts]
    return {id(p) for block in blocks for p in submodule(block, block.kind.experts).parameters()}


def _sizes(layout: RecipeLayout) -> tuple[ParallelDims, int]:
    args = layout.strategy
    pp = int(args.get("pp", 1))
    dims = ParallelDims(dp_replicate=int(args.get("dp_replicate", 1)), dp_shard=int(args.get("dp_shard", -1)),
                        cp=int(args.get("cp", 1)), tp=int(args.get("tp", 1)), ep=int(args.get("ep", 1)),
                        world_size=layout.world_size // pp)
    if layout.world_size % pp:
        raise ValueError(f"pp={pp} does not divide the world size {layout.world_size}")
    return dims, pp


def pipeline_ranks(model: nn.Module, options: dict, pp: int) -> list[tuple[list[str], bool, bool]]:
    """Per pipeline rank: its blocks (``layers.i``, MTP depths with the output), whether it holds the embedding
    and the output layer, from the strategy's own split (``pp_layout``, else balanced by FLOPs and
    parameters)."""
    mtp = [f"mtp.depths.{d}" for d in range(len(model.mtp.depths))] if getattr(model, "mtp", None) else []
    if pp == 1:
        return [([f"layers.{name}" for name in model.layers] + mtp, True, True)]

    vp = int(options.get("vp", 1))
    schedule = options.get("pp_schedule") or default_schedule(vp)
    check_schedule(schedule, pp, vp)
    specs = split_model(model, pp * vp, options.get("pp_layout"))
    ranks = []
    for rank in range(pp):
        held = [specs[i] for i in stage_indices(rank, pp, vp, schedule)]
        output = any(spec.output for spec in held)
        blocks = [f"layers.{b}" for spec in held for b in spec.blocks] + (mtp if output else [])
        ranks.append((blocks, any(spec.embedding for spec in held), output))
    return ranks


def estimate_memory(layout: RecipeLayout) -> list[RankMemory]:
    """Per-rank memory of ``layout``'s training step, one entry per kind of rank."""
    dims, pp = _sizes(layout)
    dims.check_model(layout.model)
    dims.check_seq_length(layout.seq_length)
    options = layout.strategy
    stored = stored_dtype(layout.precision)
    # FSDP's mixed precision casts the gathered parameters; without FSDP they compute in their stored dtype
    compute = dtype_option(options.get("param_dtype"), "param_dtype") if dims.fsdp_enabled else None
    reduce = dtype_option(options.get("reduce_dtype", "float32"), "reduce_dtype") or torch.float32
    _, model = build_fake_decoder(layout, stored)
    blocks = repeated_blocks(model)
    experts, tp_split = _expert_params(model), split_parameters(model)
    wrapped = ParallelOptions(param_dtype=options.get("param_dtype"), cpu_offload=bool(options.get("cpu_offload"))
                              ).fsdp_applies(dims)  # FSDP reduce-scatters every gradient to its parameter's shards
    whole_grads = whole_gradients(model) if dims.tp > 1 and not wrapped else set()
    fsdp = dims.fsdp_enabled
    dense_shards = dims.dp_shard * dims.cp if fsdp else 1
    # split over ep, FSDP shards them over the rest of the expert region; without ep, they are dense parameters
    expert_shards = dims.ep * (dims.ep_shard if fsdp else 1) if dims.ep > 1 else dense_shards

    def sharded(p: torch.Tensor) -> float:
        if id(p) in experts:
            return p.numel() / expert_shards
        return p.numel() / dense_shards / (dims.tp if id(p) in tp_split else 1)

    def unsharded(p: torch.Tensor) -> float:
        """What an all-gather over the FSDP mesh returns on a rank."""
        if id(p) in experts:
            return p.numel() / dims.ep
        return p.numel() / (dims.tp if id(p) in tp_split else 1)

    owner: dict[int, str] = {}
    for name, block in blocks:
        for p in block.parameters():
            owner[id(p)] = name
    for p in model.embed.parameters():
        owner[id(p)] = EMBEDDING
    units: dict[str, list[torch.Tensor]] = {}
    for p in model.parameters():
        units.setdefault(owner.get(id(p), OUTPUT), []).append(p)

    tokens = layout.micro_batch_size * layout.seq_length // dims.cp
    moe = layout.model.moe
    per_expert = max(1, tokens * moe.top_k // moe.num_experts) if moe is not None else 0
    mode, probed = build_fake_decoder(layout, compute or stored)
    saved = saved_activations(mode, probed, repeated_blocks(probed), layout.micro_batch_size, layout.seq_length // dims.cp,
                              per_expert)
    checkpointed = {name for name, _ in checkpointed_blocks(model, options.get("activation_checkpointing", "none"),
                                                             int(options.get("activation_checkpointing_every", 1)))}
    loss = output_loss_bytes(layout.model, tokens, dims.tp, (compute or stored).itemsize,
                             model.output_weight.requires_grad)

    ranks = []
    for stage, (names, first, last) in enumerate(pipeline_ranks(model, options, pp)):
        held = [u for u in units if u in names or (u == EMBEDDING and first) or (u == OUTPUT and last)]
        params = [p for u in held for p in units[u]]
        trainable = [p for p in params if p.requires_grad]
        memory = RankMemory(kind=_kind(stage, pp))
        c = memory.components
        c["parameters"] = sum(sharded(p) * p.element_size() for p in params)
        c["gradients"] = sum((p.numel() if id(p) in whole_grads else sharded(p)) * p.element_size()
                             for p in trainable)
        c["optimizer states"] = 2 * sum(sharded(p) * p.element_size() for p in trainable)
        if fsdp:
            def unit_bytes(unit: str, dtype: torch.dtype | None) -> float:
                return sum(unsharded(p) * (dtype.itemsize if dtype else p.element_size()) for p in units[unit])

            gathered = sorted((unit_bytes(u, compute) for u in held), reverse=True)
            grads = max((sum(unsharded(p) * reduce.itemsize for p in units[u] if p.requires_grad) for u in held),
                        default=0.0)
            c["FSDP working set"] = sum(gathered[:2]) + grads
        else:
            c["FSDP working set"] = 0.0
        kept = sum(saved.block_input.get(n, 0) if n in checkpointed else saved.per_block[n] for n in names)
        recompute = max((saved.per_block[n] for n in names if n in checkpointed), default=0)
        outside = saved.outside if (first or last) else 0
        in_flight = pp - stage  # micro-batches whose activations a 1F1B-like schedule holds on this rank
        c["activations"] = ((kept + outside) * in_flight + recompute) / dims.tp
        c["loss buffers"] = loss if last else 0.0
        memory.notes.append(f"{len(names)} blocks")
        if pp > 1:
            memory.notes.append(f"{in_flight} micro-batch(es) in flight")
        ranks.append(memory)
    return ranks


def output_loss_bytes(config, tokens: int, tp: int, itemsize: int, weight_trained: bool) -> float:
    """The fused output-layer loss (``models/layers/loss.py``) computes its gradients during forward, when
    activations peak: per output head (main and each MTP depth) it keeps the hidden states' gradient and, when
    the output weight trains, the weight's gradient for backward; while one head runs, one chunk of logits in
    the compute dtype and fp32 exists, plus an fp32 weight-gradient accumulator and its compute-dtype partial."""
    vocab, hidden = config.vocab_size / tp, config.hidden_size
    chunk = min(config.loss_chunk_size, tokens)
    half = itemsize != 4  # bf16 compute: separate fp32 buffers
    weight_grad = vocab * hidden * itemsize if weight_trained else 0.0
    kept = (1 + mtp_depths(config)) * (weight_grad + tokens * hidden * itemsize)
    running = chunk * vocab * (itemsize + (4 if half else 0))
    if weight_trained:
        running += vocab * hidden * (4 + (itemsize if half else 0))
    return kept + running


def _kind(stage: int, pp: int) -> str:
    if pp == 1:
        return "every rank"
    if stage == 0:
        return "first stage (embedding)"
    if stage == pp - 1:
        return f"last stage {stage} (output layer)"
    return f"stage {stage}"

