"""Pipeline parallelism on ``torch.distributed.pipelining``: the decoder split into stages, one schedule per step.

The ``pp`` ranks of a pipeline hold ``pp * vp`` virtual stages (``vp`` per rank). A stage is a run of consecutive
blocks; the first also holds the embedding, the last the final norm, the output layer with its loss and the MTP
depths. The split comes from an explicit ``pp_layout`` (Megatron's ``pipeline_model_parallel_layout`` idea) or is
balanced by each part's training FLOPs and parameter count (:func:`balanced_split`). A stage is the decoder
pruned to its parts and runs the decoder's own forward, which passes through the parts it lacks; it is then
parallelized like a whole model (tensor, expert, context parallel, activation checkpointing, compile, FSDP2), as
torchtitan does.

What travels between stages: the hidden states and, when the model has MTP depths, the embeddings of the tokens
ahead that those depths read (computed on the first stage, where the embedding lives, so that no weight is
copied). Every stage reads the micro-batch's token ids, positions and labels from the batch itself (pipeline peers
load the same rows): the packing layout and the label count need no communication. A stage's MoE load-balancing
loss enters the backward pass through its output (:class:`AttachLoss`), as Megatron does.

Stages keep the parameter names of the whole model, so distributed checkpoints, export and resharding to another
``pp``/``vp`` (or none) see one model. With tied embeddings the last stage holds a copy of the embedding (the same
name and initial values); the two copies' gradients are summed after each schedule (Megatron's embedding group)
and the norm counts the weight once, so both take the same steps.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from lightning_moe.models.block_flops import Sequences
from lightning_moe.models.blocks import model_kinds, pattern_kinds
from lightning_moe.models.decoder import Decoder, LossOutput
from lightning_moe.models.flops import mtp_depths, pattern_flops
from lightning_moe.models.layers.mtp import ids_ahead
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.parallel.context import ContextParallelRow

# name -> torch.distributed.pipelining schedule class name
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank: r and 2*pp-1-r
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input and weight gradients in separate passes


def default_schedule(vp: int) -> str:
    return "interleaved_1f1b" if vp > 1 else "1f1b"


def check_schedule(name: str, pp: int, vp: int) -> None:
    """One-line errors for a schedule that does not exist or does not fit ``vp`` stages per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is not one of {sorted(SCHEDULES)}")
    if not isinstance(vp, int) or isinstance(vp, bool) or vp < 1:
        raise ValueError(f"vp={vp!r} must be a positive integer (virtual stages per pipeline rank)")
    if name in SINGLE_STAGE and vp != 1:
        raise ValueError(f"pp_schedule={name!r} runs one stage per rank, but vp={vp}; use vp=1, or a multi-stage "
                         f"schedule ({', '.join(s for s in SCHEDULES if s not in SINGLE_STAGE)})")
    if name in V_SHAPED and vp != 2:
        raise ValueError(f"pp_schedule={name!r} places exactly two stages on each rank (a V); use vp=2")


def stage_indices(pp_rank: int, pp: int, vp: int, schedule: str) -> list[int]:
    """The virtual stages rank ``pp_rank`` holds: looped (r, r+pp, ...) or, for V schedules, r and 2*pp-1-r."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(vp)]


# ---------------------------------------------------------------------------------------------- the split
@dataclass
class StageSpec:
    """What one virtual stage holds: the block names, and whether it has the embedding / the output (+MTP)."""

    index: int
    blocks: list[str]
    embedding: bool
    output: bool

    def describe(self) -> str:
        parts = (["embedding"] if self.embedding else []) + [_block_range(self.blocks)]
        parts += ["output+loss"] if self.output else []
        return f"stage {self.index}: " + ", ".join(p for p in parts if p)


def _block_range(blocks: list[str]) -> str:
    if not blocks:
        return ""
    return f"layers {blocks[0]}" if len(blocks) == 1 else f"layers {blocks[0]}-{blocks[-1]}"


def parse_layout(layout: str | list[str], num_layers: int, num_stages: int, has_mtp: bool) -> list[StageSpec]:
    """An explicit split: one entry per virtual stage (a list, or one string with ``|`` between stages). An
    entry lists ``E`` (embedding), ``t`` (the next decoder block), ``m`` (the MTP depths), ``L`` (final norm,
    output layer and loss), each optionally repeated as ``t*4``: e.g. ``"Et*3|t*4|t*4|t*3mL"``."""
    entries = layout.split("|") if isinstance(layout, str) else list(layout)
    where = f"pp_layout={layout!r}"
    if len(entries) != num_stages:
        raise ValueError(f"{where} has {len(entries)} stages; pp*vp = {num_stages} are needed")
    specs, next_block, seen = [], 0, {"E": [], "L": [], "m": []}
    for index, entry in enumerate(entries):
        items = re.findall(r"([EtmL])(?:\*(\d+))?|(\S)", entry.replace(" ", ""))
        count = 0
        for symbol, repeat, bad in items:
            if bad:
                raise ValueError(f"{where}: stage {index} has {bad!r}; use E (embedding), t (a block), m (MTP), "
                                 f"L (output layer and loss), each optionally as X*n")
            times = int(repeat) if repeat else 1
            if symbol == "t":
                count += times
            else:
                seen[symbol] += [index] * times  # named twice is refused below
        if next_block + count > num_layers:
            raise ValueError(f"{where} names {next_block + count} or more blocks; the model has {num_layers}")
        blocks = [str(i) for i in range(next_block, next_block + count)]
        next_block += count
        specs.append(StageSpec(index, blocks, index in seen["E"], index in seen["L"]))
    if next_block != num_layers:
        raise ValueError(f"{where} places {next_block} blocks; the model has {num_layers} (every block once)")
    if seen["E"] != [0]:
        raise ValueError(f"{where}: the embedding (E) must be on the first stage, once")
    if seen["L"] != [num_stages - 1]:
        raise ValueError(f"{where}: the output layer and loss (L) must be on the last stage, once")
    if has_mtp and seen["m"] != [num_stages - 1]:
        raise ValueError(f"{where}: the model has MTP depths; put m on the last stage, once")
    if not has_mtp and seen["m"]:
        raise ValueError(f"{where} places MTP (m), but the model has no MTP depths")
    for spec in specs:
        if not (spec.blocks or spec.embedding or spec.output):
            raise ValueError(f"{where}: stage {spec.index} holds nothing")
    return specs


def part_costs(decoder: nn.Module, seq_len: int = 4096) -> tuple[list[float], float, float]:
    """Relative cost of each block, of the embedding and of the output (final norm, output layer, loss, MTP):
    the mean of its share of the model's training FLOPs per token at ``seq_len`` and of its share of the
    parameters (what a stage must compute, and hold with its gradients and optimizer states)."""
    cfg = decoder.config
    seqs = Sequences.of_length(min(seq_len, cfg.max_position_embeddings))
    flops = [kind.flops(cfg, seqs, attention_index).training() / seqs.tokens
             for kind, attention_index in pattern_kinds(cfg, cfg.pattern)]
    output_flops = 6.0 * cfg.hidden_size * cfg.vocab_size
    for _ in range(mtp_depths(cfg)):
        output_flops += 6.0 * (2 * cfg.hidden_size) * cfg.hidden_size + 6.0 * cfg.hidden_size * cfg.vocab_size
        output_flops += pattern_flops(cfg, cfg.mtp.pattern, seqs, cfg.pattern.count("*")).training() / seqs.tokens

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    params = [count(block) for block in decoder.layers.values()]
    embed_params = count(decoder.embed)
    output_params = count(decoder.norm) + count(decoder.lm_head) + count(decoder.mtp)
    total_flops = sum(flops) + output_flops
    total_params = sum(params) + embed_params + output_params
    blocks = [0.5 * f / total_flops + 0.5 * p / total_params for f, p in zip(flops, params)]
    return blocks, 0.5 * embed_params / total_params, 0.5 * output_flops / total_flops + 0.5 * output_params / total_params


def balanced_split(costs: list[float], embed_cost: float, output_cost: float, num_stages: int) -> list[list[int]]:
    """Consecutive blocks per stage (each stage at least one) minimizing the largest stage cost, the embedding
    counted on the first stage and the output on the last (exact dynamic programming)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:
        extra = (embed_cost if stage == 0 else 0.0) + (output_cost if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][j]: the smallest largest cost of stages 0..s-1 covering blocks 0..j-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        bounds.append(list(range(i, j)))
        j = i
    return bounds[::-1]


def split_model(decoder: nn.Module, num_stages: int, layout: str | list[str] | None = None) -> list[StageSpec]:
    """The stages of ``decoder`` (on the meta device): from ``layout`` when given, else balanced."""
    num_layers = len(decoder.layers)
    has_mtp = decoder.mtp is not None
    if layout is not None:
        return parse_layout(layout, num_layers, num_stages, has_mtp)
    if num_layers < num_stages:
        raise ValueError(f"pp*vp = {num_stages} virtual stages but the model has {num_layers} blocks; use pp*vp <= "
                         f"{num_layers}, or a pp_layout with stages that hold only the embedding or the output")
    blocks, embed_cost, output_cost = part_costs(decoder)
    groups = balanced_split(blocks, embed_cost, output_cost, num_stages)
    return [StageSpec(s, [str(i) for i in group], s == 0, s == num_stages - 1) for s, group in enumerate(groups)]


def tied_embedding_group(dims, specs: list[StageSpec], schedule: str, vp: int):
    """The process group over the two pipeline ranks that hold the first and the last stage (one group per
    data/tensor-parallel coordinate), whose embedding copies must stay equal; None when one rank holds both.
    Collective: every rank calls it."""
    import torch.distributed as dist

    owner = {i: r for r in range(dims.pp) for i in stage_indices(r, dims.pp, vp, schedule)}
    first, last = owner[0], owner[len(specs) - 1]
    if first == last:
        return None
    ranks = dims.world_mesh.mesh.reshape(dims.pp, -1)
    group, _ = dist.new_subgroups_by_enumeration([[int(ranks[first, j]), int(ranks[last, j])]
                                                  for j in range(ranks.shape[1])])
    return group if dims.pp_rank in (first, last) else None


def describe_split(specs: list[StageSpec], pp: int, schedule: str, vp: int) -> list[str]:
    """One line per virtual stage, with the pipeline rank that holds it."""
    owner = {}
    for rank in range(pp):
        for index in stage_indices(rank, pp, vp, schedule):
            owner[index] = rank
    return [f"{spec.describe()} (pipeline rank {owner[spec.index]})" for spec in specs]


# ---------------------------------------------------------------------------------------------- stage modules
class AttachLoss(torch.autograd.Function):
    """Identity on ``hidden``; the backward pass adds ``loss`` to the objective (gradient 1): how a stage's MoE
    load-balancing loss reaches backward when only the last stage's output is differentiated."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=grad.dtype, device=grad.device)


def hold_parts(part: Decoder, decoder: Decoder, blocks: list[str], embedding: bool, output: bool) -> None:
    """Give ``part`` (a new, empty module) the modules of ``decoder`` that a stage or a pipeline rank holds, by the
    decoder's names and in its module order: ``blocks``, the embedding, and with ``output`` the final norm, output
    layer and MTP depths; None for the rest, which the decoder's forward passes through. With tied embeddings the
    output holds the embedding too, for its weight (kept equal to the first stage's, see ``tied_embedding_group``)."""
    nn.Module.__init__(part)  # nothing of its own to build
    part.config = decoder.config
    part.embed = decoder.embed if embedding or (output and decoder.config.tie_embeddings) else None
    part.layers = nn.ModuleDict({name: decoder.layers[name] for name in blocks})
    part.norm = decoder.norm if output else None
    part.lm_head = decoder.lm_head if output else None
    part.output_layer = decoder.output_layer if output else None
    part.mtp = decoder.mtp if output else None


class StageModule(Decoder):
    """One virtual stage: the decoder pruned to the parts it holds (:func:`hold_parts`), so that it parallelizes
    like a decoder and runs the decoder's forward, which passes through the parts it lacks.

    ``forward(*inputs, token_ids, labels, position_ids=None)``, what torch's pipeline stage calls: ``inputs`` are
    the token ids on the first stage, else what the previous stage sent. Returns ``(hidden, *ahead_embeddings)``,
    or on the last stage the micro-batch's objective (loss sum + weighted MTP sums + aux losses, to be divided by
    the global label count). Each forward appends its loss sums to :attr:`sums` (detached).
    """

    def __init__(self, decoder: Decoder, spec: StageSpec, mtp_scale: float) -> None:
        hold_parts(self, decoder, spec.blocks, spec.embedding, spec.output)
        self.spec = spec
        self.mtp_scale = mtp_scale
        self.sums: list[dict[str, torch.Tensor]] = []
        # under context parallelism: the group the row's chunks are spread over (the tokens ahead that MTP reads
        # come from the whole row)
        self.context_parallel_group = None
        # torch's stage infers the shapes it sends by one forward of its own before the first step (on empty
        # tensors past the first stage): that forward must leave no loss sums and no expert token counts
        self.metadata_pass_pending = False
        # host layouts of the step's micro-batches, in the order the schedule runs their forwards on this stage
        self.layouts: deque = deque()

    def forward(self, *inputs: torch.Tensor, token_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None):
        if not self.metadata_pass_pending:
            host = self.layouts.popleft() if self.layouts else None
            return self._forward(*inputs, token_ids=token_ids, labels=labels, position_ids=position_ids, host=host)
        self.metadata_pass_pending = False
        inputs = metadata_pass_inputs(inputs, self.spec.embedding)
        counts = [moe.tokens_per_expert.clone() for moe in self.moe_layers()]
        try:  # the first micro-batch's layout, which its real forward takes next
            return self._forward(*inputs, token_ids=token_ids, labels=labels, position_ids=position_ids,
                                 host=self.layouts[0] if self.layouts else None)
        finally:
            self.sums.clear()
            for moe, count in zip(self.moe_layers(), counts):
                moe.tokens_per_expert.copy_(count)

    def _forward(self, *inputs: torch.Tensor, token_ids: torch.Tensor, labels: torch.Tensor,
                 position_ids: torch.Tensor | None, host=None):
        layout = SequenceLayout.from_inputs(token_ids, position_ids, host)
        if self.context_parallel_group is not None and layout.context_parallel is None:
            # what the first attention block would attach; the MTP ids and depths need it on every stage
            layout.context_parallel = ContextParallelRow(layout.position_ids, self.context_parallel_group,
                                                         layout.host)
        first, *ahead = inputs
        out = super().forward(first, labels=labels, layout=layout, ahead=ahead)
        if self.norm is not None:
            return self._objective(out)
        if self.spec.embedding:  # the embeddings of the tokens ahead that the MTP depths read
            ahead = [self.embed(ids) for ids in ids_ahead(token_ids, layout, mtp_depths(self.config))]
        sums: dict[str, torch.Tensor] = {}
        aux = self._collect_aux_loss()
        if aux is not None:  # into backward with the hidden states sent
            weighted = aux * (labels != -100).sum()
            sums["aux_loss"] = weighted.detach()
            out = AttachLoss.apply(out, weighted)
        self.sums.append(sums)
        return (out, *ahead)

    def _objective(self, out: LossOutput) -> torch.Tensor:
        """The last stage's output: what the schedule differentiates; its parts go to :attr:`sums`."""
        sums = {"loss_sum": out.loss_sum.detach(), "label_tokens": out.num_label_tokens.detach()}
        objective = out.loss_sum
        if out.mtp_loss_sums:
            weight = self.mtp_scale / len(out.mtp_loss_sums)
            for depth, (mtp_sum, mtp_count) in enumerate(zip(out.mtp_loss_sums, out.mtp_label_tokens), start=1):
                objective = objective + weight * mtp_sum
                sums[f"mtp_{depth}_loss_sum"], sums[f"mtp_{depth}_tokens"] = mtp_sum.detach(), mtp_count.detach()
        if out.aux_loss is not None:
            objective = objective + out.aux_loss * out.num_label_tokens
            sums["aux_loss"] = (out.aux_loss * out.num_label_tokens).detach()
        self.sums.append(sums)
        return objective


def metadata_pass_inputs(inputs: tuple[torch.Tensor, ...], first: bool) -> tuple[torch.Tensor, ...]:
    """Past the first stage torch's shape-inference forward passes uninitialized tensors (``torch.empty``): they
    are replaced by fixed random values, so that nothing in that pass (a compiled block's first-use check against
    eager, ``kernels/compiled_blocks.py``) computes on garbage such as inf or NaN. The values stay a function of
    the tensors passed (``where``, gradient zero), as torch differentiates the pass's outputs by them."""
    if first:
        return inputs
    generator = torch.Generator(device=inputs[0].device).manual_seed(0)
    replaced = []
    for t in inputs:
        if t.is_floating_point():
            noise = torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator)
            t = torch.where(torch.ones_like(t, dtype=torch.bool), noise, t)
        replaced.append(t)
    return tuple(replaced)


class PipelinedDecoder(Decoder):
    """The parts of the decoder this rank's stages hold (:func:`hold_parts`), under the whole model's names: what
    the optimizer, checkpoints, export and the layout-invariant initialization see. Training and evaluation run
    through :attr:`stages`, not ``forward``."""

    def __init__(self, decoder: Decoder, specs: list[StageSpec], local: list[int], mtp_scale: float) -> None:
        mine = [specs[i] for i in local]
        hold_parts(self, decoder, [name for s in mine for name in s.blocks], any(s.embedding for s in mine),
                   any(s.output for s in mine))
        # a plain list: the stages share these modules, registering them twice would repeat every name
        self.stages = [StageModule(decoder, specs[i], mtp_scale) for i in local]
        self.held_elsewhere: frozenset[str] = frozenset()  # set by the split (parallel/pipeline_stages.py)

    def sum_names(self, training: bool = True) -> list[str]:
        """The keys of the sums every pipeline rank reduces (the same list on every rank)."""
        cfg = self.config
        names = ["loss_sum", "label_tokens"]
        if not training:
            return names
        if any(kind.experts is not None for kind in model_kinds(cfg)) and cfg.moe.aux_loss_coeff > 0:
            names.append("aux_loss")
        for depth in range(1, mtp_depths(cfg) + 1):
            names += [f"mtp_{depth}_loss_sum", f"mtp_{depth}_tokens"]
        return names

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined decoder runs through its pipeline schedule (lightning_moe.parallel.pipeline)")
