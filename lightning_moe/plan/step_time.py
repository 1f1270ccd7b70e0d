"""Predicted step time of a recipe's layout on a GPU, from the package's own counts.

Two halves. :func:`workload` reads what the layout does, independent of the hardware: the training FLOPs of each
block kind from the block records (``models/blocks.py``, the formulas ``models/flops.py`` sums), the bytes of
each collective per mesh dimension from ``parallel/comm.py``'s :func:`model_comm_bytes` (the count the run card
reports), and the per-rank memory from ``estimate/memory.py``. :func:`predict` turns a workload into seconds on
a :class:`~lightning_moe.plan.hardware.Hardware` with its efficiency constants:

- compute, per GPU and optimizer step (the global step's FLOPs over the GPUs; recomputed forwards of
  checkpointed blocks included): GEMMs at ``gemm x side / (side + gemm_knee)`` of the GEMM precision's peak,
  ``side`` the smallest side of the GEMM on one rank (tokens of a micro-batch, the width after tensor
  parallelism; for routed experts the tokens each local expert receives); attention scores at ``attention x
  gemm`` of the bf16 peak, chunked linear-attention and SSD scans at ``scan x gemm``;
- element-wise passes (norms, residuals, activations, rotary, the MoE permutations) and the optimizer's pass over
  this rank's parameters, gradients and Adam moments, at HBM bandwidth;
- communication per mesh dimension: each collective's counted bytes times its wire factor (``(n-1)/n`` for
  all-gather, reduce-scatter and all-to-all, ``2(n-1)/n`` for all-reduce, 1 for a send) over the link its group
  crosses (the mesh is row-major ``(pp, dp_replicate, dp_shard, cp, tp)``, experts on ``(…, ep_shard, ep)``: a
  group whose ranks fit in one NVLink domain uses NVLink, else the network; an all-to-all splits its traffic
  between the two), at ``link`` of the bandwidth;
- overlap: FSDP's all-gathers and reduce-scatters (and HSDP's all-reduce) are prefetched behind compute, so
  only what exceeds ``overlap x compute`` is exposed; tensor-, context- and expert-parallel collectives and
  pipeline sends sit on the critical path (exposed);
- the pipeline bubble: ``(pp - 1) / (vp x m)`` of the per-rank work for ``m`` micro-batches per step (half of
  that for the schedules that split the backward pass: zero-bubble and DualPipeV).

A dimension ``model_comm_bytes`` does not count yet (it raises ``NotImplementedError`` naming it) is reported as
"not counted" and adds no time; the others are then counted without it (a pipeline's at ``pp=1``, scaled by the
stage's ``1/pp`` share of the blocks) and marked approximate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from lightning_moe.estimate.memory import GIB, RankMemory, estimate_memory, stored_dtype
from lightning_moe.estimate.recipe import RecipeLayout
from lightning_moe.models.block_flops import Sequences, feed_forward_flops
from lightning_moe.models.blocks import pattern_kinds
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.flops import forward_flops, mtp_depths, mtp_projection_flops, output_layer_flops
from lightning_moe.parallel.activation_checkpoint import checkpointed_blocks, repeated_blocks
from lightning_moe.parallel.comm import StepShape, model_comm_bytes
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.pipeline import SPLIT_BACKWARD, check_schedule, default_schedule
from lightning_moe.plan.hardware import Hardware

FSDP_DIMS = ("fsdp", "expert_fsdp", "dp_replicate")  # prefetched behind compute
WIRE = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0, "send": None, "recv": None}


@dataclass
class Compute:
    """One compute item of a step on one GPU."""

    label: str  # block kind and part: "moe: routed experts", "gqa: scores", "output layer", ...
    kind: str  # gemm | attention | scan
    flops: float  # per GPU per optimizer step (recomputed forwards included)
    side: float  # the smallest GEMM side on one rank (elements)
    low_precision: bool = False  # runs at the FP8 / MXFP8 peak


@dataclass
class Comm:
    kind: str
    dim: str
    bytes: float
    ranks: int
    offnode: float  # share of the traffic on the network (0: NVLink only)
    approximate: bool = False


@dataclass
class Workload:
    """What one optimizer step of a layout does, before any hardware enters."""

    layout: RecipeLayout
    dims: ParallelDims
    pp: int
    vp: int
    schedule: str
    micro_batches: int  # per rank per optimizer step
    global_rows: int
    model_flops: float  # per GPU per step, the model's training FLOPs (no recompute): what TFLOP/s reports
    compute: list[Compute]
    hidden_pass_bytes: float  # one pass over every block's hidden states, per GPU per step
    moe_copy_bytes: float  # the MoE layers' token copies, per GPU per step
    comm: list[Comm]
    not_counted: dict[str, str]  # mesh dimension -> why
    memory: list[RankMemory]
    gemm_precision: str
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_rows * self.layout.seq_length

    def peak_memory(self) -> float:
        return max(rank.total for rank in self.memory)

    @property
    def optimizer_bytes(self) -> float:
        """The largest rank's optimizer pass: parameters, gradients and Adam moments read, parameters and
        moments written (0 before the memory is estimated)."""
        if not self.memory:
            return 0.0
        c = max(self.memory, key=lambda r: r.total).components
        return 2 * c.get("parameters", 0.0) + c.get("gradients", 0.0) + 2 * c.get("optimizer states", 0.0)


def strategy_dims(layout: RecipeLayout) -> tuple[ParallelDims, int, str]:
    """The layout's sizes (``pp`` included), ``vp`` and pipeline schedule; the package's own checks raise a
    one-line ``ValueError`` for a layout it refuses."""
    args = layout.strategy
    pp, vp = int(args.get("pp", 1)), int(args.get("vp", 1))
    schedule = args.get("pp_schedule") or default_schedule(vp)
    if pp > 1:
        check_schedule(schedule, pp, vp)
    dims = ParallelDims(pp=pp, dp_replicate=int(args.get("dp_replicate", 1)), dp_shard=int(args.get("dp_shard", -1)),
                        cp=int(args.get("cp", 1)), tp=int(args.get("tp", 1)), ep=int(args.get("ep", 1)),
                        world_size=layout.world_size)
    dims.check_model(layout.model)
    dims.check_seq_length(layout.seq_length)
    return dims, vp, schedule


def step_rows(layout: RecipeLayout, dims: ParallelDims) -> tuple[int, int]:
    """Rows of the global batch and micro-batches per rank per optimizer step (the data module's rule)."""
    per_pass = layout.micro_batch_size * dims.dp_size
    rows = layout.global_batch_size or per_pass
    if rows % per_pass:
        raise ValueError(f"global_batch_size {rows} must be divisible by micro_batch_size * data-parallel size = "
                         f"{layout.micro_batch_size} * {dims.dp_size} = {per_pass}")
    return rows, rows // per_pass


def gemm_precision(layout: RecipeLayout) -> str:
    if layout.fp8 is None:
        return "bf16"
    return "mxfp8" if layout.fp8.is_mx else "fp8"


def _trainable_fraction(layout: RecipeLayout) -> float:
    if layout.peft is None and not layout.freeze:
        return 1.0
    from lightning_moe.estimate.memory import build_fake_decoder

    _, model = build_fake_decoder(layout, stored_dtype(layout.precision))
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad) / max(sum(p.numel() for p in params), 1)


def compute_items(layout: RecipeLayout, dims: ParallelDims, rows: int, micro_batches: int,
                  trainable: float) -> tuple[list[Compute], float]:
    """Per-GPU compute items of one step and the model's training FLOPs per GPU (forward_flops' total)."""
    cfg, seq, n = layout.model, layout.seq_length, layout.world_size
    seqs = Sequences.of_length(seq, rows)
    mode = str(layout.strategy.get("activation_checkpointing", "none"))
    every = int(layout.strategy.get("activation_checkpointing_every", 1))
    with torch.device("meta"):
        model = Decoder(cfg)
    order = [name for name, _ in repeated_blocks(model)]
    recomputed = {name for name, _ in checkpointed_blocks(model, mode, every)}
    low = gemm_precision(layout) != "bf16"
    mx_experts = low and layout.fp8.is_mx and not any("expert" in f for f in layout.fp8.filter_fqns)
    tokens = layout.micro_batch_size * seq / dims.cp  # one micro-batch on a rank (TP gathers the sequence)
    items: dict[tuple[str, str], Compute] = {}

    def add(label: str, kind: str, flops: float, side: float, low_precision: bool = False) -> None:
        item = items.setdefault((label, kind), Compute(label, kind, 0.0, side, low_precision))
        item.flops += flops / n

    def blocks(pattern: str, first: int, again: list[bool], repeats: int = 1) -> None:
        for (kind, index), twice in zip(pattern_kinds(cfg, pattern, first), again):
            f = kind.flops(cfg, seqs, index)
            passes = 2 + trainable + twice  # forward, input gradients, weight gradients, a recomputed forward
            weights = repeats * f.weights * passes
            if kind.experts:
                moe = cfg.moe
                width = moe.latent_size or cfg.hidden_size
                routed = repeats * moe.top_k * feed_forward_flops(rows * seq, width, moe.intermediate_size,
                                                                  moe.activation) * passes
                per_expert = tokens / dims.tp * moe.top_k * dims.ep / moe.num_experts
                add(f"{kind.name}: routed experts", "gemm", routed,
                    min(per_expert, moe.intermediate_size, width), mx_experts)
                weights -= routed
            if weights:
                add(f"{kind.name}: GEMMs", "gemm", weights, min(tokens, cfg.hidden_size / dims.tp), low)
            if f.activations:
                attention = kind.name in ("gqa", "mla")
                add(f"{kind.name}: {'scores' if attention else 'scan'}", "attention" if attention else "scan",
                    repeats * f.activations * (3 + twice), tokens)

    blocks(cfg.pattern, 0, [name in recomputed for name in order if name.startswith("layers.")])
    depths = mtp_depths(cfg)
    if depths:
        twice = any(name.startswith("mtp.") for name in recomputed)
        eh = mtp_projection_flops(cfg, rows * seq)
        add("mtp: projections", "gemm", depths * eh * (2 + trainable + twice), min(tokens, cfg.hidden_size), low)
        blocks(cfg.mtp.pattern, cfg.pattern.count("*"), [twice] * len(cfg.mtp.pattern), depths)
    output = output_layer_flops(cfg, rows * seq) * (1 + depths)
    add("output layer", "gemm", output * (2 + trainable), min(tokens, cfg.hidden_size))
    model_flops = forward_flops(cfg, seqs).training(trainable) / n
    return list(items.values()), model_flops


def elementwise_bytes(layout: RecipeLayout, rows: int, itemsize: int) -> tuple[float, float]:
    """Bytes the element-wise work moves per GPU per step: one pass over every block's hidden states, and the
    MoE layers' copies (permute, un-permute and the experts' activations, forward and backward)."""
    cfg = layout.model
    tokens = rows * layout.seq_length / layout.world_size
    depths = mtp_depths(cfg)
    # (pattern, its first attention index, how often it runs): the backbone, then the MTP depths
    patterns = [(cfg.pattern, 0, 1)] + ([(cfg.mtp.pattern, cfg.pattern.count("*"), depths)] if depths else [])
    blocks = sum(len(pattern) * runs for pattern, _, runs in patterns)
    hidden, total = blocks * cfg.hidden_size * itemsize * tokens, 0.0
    if cfg.moe is not None:
        moe_blocks = sum(runs * sum(kind.experts is not None for kind, _ in pattern_kinds(cfg, pattern, first))
                         for pattern, first, runs in patterns)
        width = cfg.moe.latent_size or cfg.hidden_size
        total += moe_blocks * tokens * cfg.moe.top_k * (4 * width + 6 * cfg.moe.intermediate_size) * itemsize
    return hidden, total


def _group(dims: ParallelDims, dim: str) -> tuple[int, int]:
    """``(ranks, stride)`` of a mesh dimension's groups over the row-major rank order."""
    tp, cp = dims.tp, dims.cp
    return {
        "tp": (tp, 1), "cp": (cp, tp), "fsdp": (dims.dp_shard * cp, tp),
        "dp_replicate": (dims.dp_replicate, dims.dp_shard * cp * tp), "ep": (dims.ep, 1),
        "expert_fsdp": (dims.ep_shard, dims.ep), "pp": (dims.pp, dims.world_size // dims.pp),
    }.get(dim, (dims.world_size, 1))


def offnode_share(ranks: int, stride: int, domain: int) -> float:
    """Share of a group's peers outside this rank's NVLink domain."""
    if ranks <= 1 or ranks * stride <= domain:
        return 0.0
    inside = max(domain // stride, 1)  # members of the group in one domain
    return (ranks - inside) / (ranks - 1)


def comm_items(layout: RecipeLayout, dims: ParallelDims, micro_batches: int, domain: int, schedule: str = "1f1b"
               ) -> tuple[list[Comm], dict[str, str], list[str]]:
    """The collectives of one step from :func:`model_comm_bytes` (under a pipeline: the busiest stage's, per
    collective); dimensions it refuses are named, not guessed."""
    args = layout.strategy
    stored = stored_dtype(layout.precision)
    from lightning_moe.dtypes import dtype_option

    shape = StepShape(rows=layout.micro_batch_size, seq_len=layout.seq_length, micro_batches=micro_batches,
                      dtype=stored, param_dtype=dtype_option(args.get("param_dtype"), "param_dtype"),
                      reduce_dtype=dtype_option(args.get("reduce_dtype", "float32"), "reduce_dtype") or torch.float32,
                      activation_checkpointing=str(args.get("activation_checkpointing", "none")),
                      activation_checkpointing_every=int(args.get("activation_checkpointing_every", 1)),
                      pipeline_schedule=schedule, pipeline_layout=args.get("pp_layout"))
    not_counted: dict[str, str] = {}
    notes: list[str] = []
    counted_dims, scale = dims, 1.0
    while True:
        try:
            stages = [model_comm_bytes(layout.model, counted_dims, shape, pp_rank=rank)
                      for rank in range(counted_dims.pp)]
            counts = {key: max(stage.get(key, 0) for stage in stages) for key in set().union(*stages)}
            break
        except NotImplementedError as error:
            reason = str(error)
            dropped = next((d for d in ("pp", "tp", "cp", "dp_replicate") if getattr(counted_dims, d) > 1), None)
            if dropped is None:
                not_counted["all"] = reason
                return [], not_counted, notes
            not_counted[dropped] = reason
            size = getattr(counted_dims, dropped)
            if dropped == "pp":
                scale /= size  # a stage holds 1/pp of the blocks
            sizes = {name: getattr(counted_dims, name) for name in ("pp", "dp_replicate", "cp", "tp", "ep")}
            sizes[dropped] = 1
            try:
                counted_dims = ParallelDims(**sizes, dp_shard=counted_dims.dp_shard,
                                            world_size=counted_dims.world_size // size)
            except ValueError:
                not_counted["all"] = reason
                return [], not_counted, notes
            notes.append(f"{dropped}={size}: {reason}; the other dimensions counted without it (approximate)")
    items = []
    for (kind, dim), size in sorted(counts.items()):
        ranks, stride = _group(dims, dim)
        items.append(Comm(kind, dim, size * scale, ranks, offnode_share(ranks, stride, domain),
                          approximate=bool(not_counted)))
    return items, not_counted, notes


def workload(layout: RecipeLayout, memory: bool = True, domain: int = 8) -> Workload:
    """Everything the step-time model needs from ``layout`` (``memory=False`` skips the memory estimate)."""
    dims, vp, schedule = strategy_dims(layout)
    rows, micro_batches = step_rows(layout, dims)
    trainable = _trainable_fraction(layout)
    compute, model_flops = compute_items(layout, dims, rows, micro_batches, trainable)
    comm, not_counted, notes = comm_items(layout, dims, micro_batches, domain, schedule)
    ranks = estimate_memory(layout) if memory else []
    itemsize = 2 if layout.precision.startswith(("bf16", "16")) else 4
    hidden_pass, moe_copies = elementwise_bytes(layout, rows, itemsize)
    return Workload(layout=layout, dims=dims, pp=dims.pp, vp=vp, schedule=schedule, micro_batches=micro_batches,
                    global_rows=rows, model_flops=model_flops, compute=compute,
                    hidden_pass_bytes=hidden_pass, moe_copy_bytes=moe_copies,
                    comm=comm, not_counted=not_counted, memory=ranks, gemm_precision=gemm_precision(layout),
                    notes=notes)


@dataclass
class Prediction:
    step_time_s: float
    compute_s: dict[str, float]  # per compute item
    elementwise_s: float
    optimizer_s: float
    comm_s: dict[str, float]  # per mesh dimension, all of it
    exposed_s: dict[str, float]  # per mesh dimension, what compute does not hide
    bubble_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    fits: bool

    def breakdown(self) -> dict[str, float]:
        return {**{f"compute: {k}": v for k, v in self.compute_s.items()}, "element-wise": self.elementwise_s,
                "optimizer": self.optimizer_s, **{f"comm exposed: {k}": v for k, v in self.exposed_s.items()},
                "pipeline bubble": self.bubble_s}


def gemm_efficiency(side: float, gemm: float, knee: float) -> float:
    return gemm * side / (side + knee)


def predict(work: Workload, hw: Hardware, constants=None) -> Prediction:
    k = constants or hw.constants
    compute: dict[str, float] = {}
    for item in work.compute:
        if item.kind == "gemm":
            rate = hw.peak(work.gemm_precision if item.low_precision else "bf16") * gemm_efficiency(
                item.side, k.gemm, k.gemm_knee)
        else:
            rate = hw.peak("bf16") * k.gemm * (k.attention if item.kind == "attention" else k.scan)
        compute[item.label] = compute.get(item.label, 0.0) + item.flops / rate
    elementwise = (work.hidden_pass_bytes * k.elementwise + work.moe_copy_bytes) / hw.hbm_bytes_per_s
    optimizer = work.optimizer_bytes / hw.hbm_bytes_per_s
    comm: dict[str, float] = {}
    for c in work.comm:
        wire = WIRE.get(c.kind)
        wire = 1.0 if wire is None else wire * (c.ranks - 1) / max(c.ranks, 1)
        size = c.bytes * wire
        nvlink = size * (1 - c.offnode) / (k.link * hw.nvlink_bytes_per_s)
        network = size * c.offnode / (k.link * hw.network_bytes_per_s)
        # a ring collective runs at its slowest link; an all-to-all sends on both links at once
        seconds = max(nvlink, network) if c.kind == "all_to_all" else (
            size / (k.link * hw.network_bytes_per_s) if c.offnode else nvlink)
        comm[c.dim] = comm.get(c.dim, 0.0) + seconds
    busy = sum(compute.values()) + elementwise
    exposed = {dim: t for dim, t in comm.items() if dim not in FSDP_DIMS}
    critical = busy + sum(exposed.values())
    fsdp = sum(t for dim, t in comm.items() if dim in FSDP_DIMS)
    hidden_behind = k.overlap * critical
    fsdp_exposed = max(0.0, fsdp - hidden_behind)
    for dim in FSDP_DIMS:
        if dim in comm:
            exposed[dim] = fsdp_exposed * comm[dim] / fsdp if fsdp else 0.0
    bubble = 0.0
    if work.pp > 1:
        share = (work.pp - 1) / (work.vp * work.micro_batches)
        bubble = share * critical * (0.5 if work.schedule in SPLIT_BACKWARD else 1.0)
    step = critical + fsdp_exposed + bubble + optimizer
    tokens = work.tokens_per_step / work.world_size / step
    tflops = work.model_flops / step
    peak_memory = work.peak_memory() if work.memory else 0.0
    return Prediction(step_time_s=step, compute_s=compute, elementwise_s=elementwise, optimizer_s=optimizer,
                      comm_s=comm, exposed_s=exposed, bubble_s=bubble, tokens_per_s_per_gpu=tokens,
                      tflops_per_gpu=tflops / 1e12, mfu=tflops / hw.peak(work.gemm_precision),
                      peak_memory_bytes=peak_memory,
                      fits=bool(work.memory) and peak_memory <= hw.memory_gib * GIB)


def with_constants(hw: Hardware, **values: float) -> Hardware:
    return dataclasses.replace(hw, constants=dataclasses.replace(hw.constants, **values))
