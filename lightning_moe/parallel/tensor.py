"""Tensor parallelism with sequence parallelism (Megatron-style), as DTensor plans over the decoder's blocks.

Between blocks the residual stream is split along the sequence (``Shard(1)``, sequence parallelism), so norms
and residual adds run on ``seq / tp`` tokens. Entering attention or a dense MLP the tokens are all-gathered;
q/k/v and gate/up are split by output columns (whole heads / intermediate channels per rank), o and down by
input rows, and their partial sums are reduce-scattered back to sequence shards. The embedding is split by
vocabulary rows, and so is the output layer, whose cross entropy is vocabulary-parallel (local log-sum-exp
and target logit, all-reduced), so full-vocabulary logits never exist on one rank.

Routed experts are never split by channels: each rank routes its own sequence shard (the router and a latent
projection are replicated over the tensor-parallel ranks, their gradients summed, as every rank saw different
tokens) and dispatches it to the experts. Without expert parallelism the experts are replicated likewise; with
it they are split over the ``ep`` mesh, which may span tensor-parallel ranks (``parallel/dims.py``). Shared
experts are a dense MLP: split by channels like one, on the gathered sequence. The load-balancing loss is the
mean of the shards' losses, as for micro-batches.

MLA splits its up projections by heads (the low-rank down projections are replicated); MTP depths reuse the
block plans. Mamba-2 mixers (and Gated DeltaNet, KDA) keep their weights replicated too: each rank projects its sequence shard and trades
tokens for heads with the others (``parallel/mamba.py``), so the scan of a head runs over the whole row on one
rank. Supported: GQA/MHA (qk-norm, biases, sinks, sliding windows) and MLA attention, Mamba-2, dense MLPs, MoE,
MTP, tied or untied output. LoRA-wrapped linears are split together with their adapters
(``parallel/lora_tensor.py``); the frozen base stays frozen.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.blocks import Linears, submodule
from lightning_moe.models.blocks import split_linears as block_split_linears
from lightning_moe.models.layers.loss import OutputLayer, linear_cross_entropy
from lightning_moe.parallel.collectives import all_gather_autograd, reduce_scatter_autograd
from lightning_moe.parallel.local_params import use_local_parameters
from lightning_moe.parallel.lora_tensor import (
    LoraColwiseParallel,
    LoraRowwiseParallel,
    is_lora_linear,
    lora_parts,
    lora_placement,
    shard_lora_locally,
)
from lightning_moe.parallel.mamba import heads_over_whole_rows
from lightning_moe.precision.fp8_tensor_parallel import (
    float8_style,
    is_low_precision_linear,
    prepare_input_style,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh, expert_parallel: bool = False) -> None:
    """Split ``model`` (a Decoder, still on the meta device) over ``tp_mesh``; with ``expert_parallel`` the
    routed experts are left for expert parallelism to split."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    # torch's styles make new parameters that require gradients: frozen ones (LoRA's base) stay frozen
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    # torchao's FP8 styles move FP8 tensors in collectives, which gloo lacks: on gloo, torch's styles split the
    # FP8 layers (the same numbers, collectives in high precision)
    fp8_gather = torch.distributed.get_backend(tp_mesh.get_group()) != "gloo"
    # a pipeline stage (parallel/pipeline.py) holds only some of these: the embedding on the first stage (and,
    # tied, as the output weight on the last), the final norm and output layer on the last
    outer = {"embed": _embedding_parallel()(input_layouts=Replicate(), output_layouts=Shard(1)),
             "norm": SequenceParallel(use_local_output=True)}
    parallelize_module(model, tp_mesh, {name: style for name, style in outer.items()
                                        if getattr(model, name, None) is not None})
    if model.lm_head is not None:
        # never called as a module: the output layer reads the weight (see VocabParallelOutput)
        model.lm_head.weight = nn.Parameter(distribute_tensor(model.lm_head.weight, tp_mesh, [Shard(0)]))
    blocks = list(model.layers.values())
    if model.mtp is not None:
        for depth in model.mtp.depths:
            blocks += list(depth.layers.values())
            parallelize_module(depth, tp_mesh, {"final_norm": SequenceParallel(use_local_output=True)})
            for module in (depth.enorm, depth.hnorm, depth.eh_proj):
                _replicate_over_sequence_shards(module, tp_mesh)
    for block in blocks:
        split = block.kind.tensor
        parallelize_module(block, tp_mesh, _block_plan(block, fp8_gather))
        if split.local is not None:
            _shard_locally(submodule(block, split.local.owner), split.local, tp_mesh)
        experts = (block.kind.experts,) if block.kind.experts and not expert_parallel else ()
        for name in split.replicated + experts:
            if submodule(block, name) is not None:
                _replicate_over_sequence_shards(submodule(block, name), tp_mesh)
        if split.trades_heads:  # replicated weights, heads over whole rows
            block.op.forward = heads_over_whole_rows(block.op, tp_mesh.get_group(), _rows_in_order)
        if split.shard_loss:
            block.op.register_forward_hook(_average_aux_loss_over(tp_mesh.get_group()))
        for name in split.sharded:
            owner_name, leaf = name.rsplit(".", 1)
            owner = submodule(block, owner_name)
            if getattr(owner, leaf, None) is not None:
                setattr(owner, leaf, nn.Parameter(distribute_tensor(getattr(owner, leaf), tp_mesh, [Shard(0)])))
                use_local_parameters(owner, names=[leaf])
    if model.output_layer is not None:
        model.output_layer = VocabParallelOutput(tp_mesh, model.output_layer.repeatable_backward)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def _embedding_parallel():
    from torch.distributed.tensor.parallel import RowwiseParallel

    class EmbeddingParallel(RowwiseParallel):
        """The embedding split by vocabulary rows, its partial outputs reduce-scattered to sequence shards and waited
        for: a pending collective (``AsyncCollectiveTensor``) entering a compiled block comes back from the block's
        backward as a plain gradient, which the redistribution's backward cannot take."""

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
            return outputs.to_local() if use_local_output else outputs

    return EmbeddingParallel


def _rows_in_order(layout):
    # sequence shards are contiguous and the ranks see the whole batch: the layout is already the whole row's
    return None, layout


def _block_plan(block: nn.Module, fp8_gather: bool) -> dict:
    """The DTensor plan of a block: its norm over sequence shards, the linears its record runs on the gathered
    sequence, the per-head norms of the local heads."""
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = {"norm": SequenceParallel(use_local_output=True)}
    for group in block.kind.tensor.gathered:
        if submodule(block, group.owner) is not None:
            plan.update(_gathered_plan(block, group, fp8_gather))
    for name in block.kind.tensor.head_norms:
        if submodule(block, name) is not None:
            # per-head norms over local heads; the weight is shared by all heads, so its gradient is summed
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _gathered_plan(block: nn.Module, group: Linears, fp8_gather: bool) -> dict:
    """Linears on the gathered sequence: the column-wise ones split by output channels, the row-wise ones by
    input rows, their partial sums reduce-scattered back to sequence shards. An op that mixes the sequence takes
    the layout after the hidden states."""
    from torch.distributed.tensor import Replicate, Shard

    owner = submodule(block, group.owner)
    columns = [leaf for leaf in group.columns if getattr(owner, leaf, None) is not None]
    consumers = [getattr(owner, leaf) for leaf in columns] if fp8_gather else []
    layouts = (None,) if group.owner == block.op_name and block.mixes_sequence else ()
    plan = {group.owner: prepare_input(consumers, input_layouts=(Shard(1), *layouts),
                                       desired_input_layouts=(Replicate(), *layouts))}
    for leaf in columns:
        plan[f"{group.owner}.{leaf}"] = colwise(getattr(owner, leaf), fp8_gather)
    for leaf in group.rows:
        plan[f"{group.owner}.{leaf}"] = rowwise(getattr(owner, leaf), fp8_gather, output_layouts=Shard(1))
    return plan


def colwise(linear: nn.Module, fp8_collectives: bool = True, **layouts):
    """The column-wise style for ``linear`` as the converters left it: plain, LoRA-wrapped (the adapter split
    with it, ``parallel/lora_tensor.py``), FP8/MXFP8 (``precision/fp8_tensor_parallel.py``; torchao's FP8 styles
    only with ``fp8_collectives``)."""
    return (fp8_collectives and float8_style(linear, "colwise", **layouts)) or LoraColwiseParallel(**layouts)


def rowwise(linear: nn.Module, fp8_collectives: bool = True, **layouts):
    """The row-wise style for ``linear`` (see :func:`colwise`)."""
    return (fp8_collectives and float8_style(linear, "rowwise", **layouts)) or LoraRowwiseParallel(**layouts)


def prepare_input(consumers: list[nn.Module], **layouts):
    """Gathering a module's sequence-parallel input for ``consumers``: in FP8 when they all take FP8 inputs
    (no consumers: in high precision)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput


    return prepare_input_style(consumers, **layouts) or PrepareModuleInput(**layouts)


def split_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """``(name, linear, split dimension)`` of every linear the plans split (``out``: column-wise, ``in``:
    row-wise), for checks before any is split."""
    for prefix, block in _named_blocks(model):
        for name, linear, style in block_split_linears(block, prefix):
            yield name, linear, "out" if style == "colwise" else "in"


def split_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters tensor parallelism divides over its ranks (the rest, and the routed experts, stay
    whole on every tensor-parallel rank): the embedding and output rows, the split linears' weights (and the
    column-wise ones' biases, with each LoRA adapter split like its base) and the sharded per-head parameters,
    as :func:`apply_tensor_parallel` places them. The memory estimate reads it."""
    return set(split_dimensions(model))


def split_dimensions(model: nn.Module) -> dict[int, int]:
    """``{id(parameter): the dimension tensor parallelism splits}`` of :func:`split_parameters`' parameters (the
    communication count sizes each rank's shards with it)."""
    from torch.distributed.tensor import Replicate

    # a pipeline stage may hold neither the embedding nor the output layer
    split = {id(layer.weight): 0 for layer in (model.embed, model.lm_head) if layer is not None}
    for prefix, block in _named_blocks(model):
        for _, linear, style in block_split_linears(block, prefix):
            for part, module in lora_parts(linear):
                for leaf, param in module.named_parameters(recurse=False):
                    placement = lora_placement(style, part, leaf)
                    if placement != Replicate():
                        split[id(param)] = placement.dim
        for name in block.kind.tensor.sharded:
            param = submodule(block, name)
            if param is not None:
                split[id(param)] = 0
    return split


def whole_gradients(model: nn.Module) -> set[int]:
    """Ids of split parameters whose gradient tensor parallelism leaves whole on every rank: the embedding's
    (its vocabulary-parallel backward returns a replicated gradient) until FSDP reduce-scatters it."""
    return {id(model.embed.weight)}


def _named_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from ((f"layers.{n}", block) for n, block in model.layers.named_children())
    if model.mtp is not None:
        yield from ((f"mtp.depths.{d}.layers.{n}", b) for d, depth in enumerate(model.mtp.depths)
                    for n, b in depth.layers.named_children())


def _distribute_parameters(module: nn.Module, tp_mesh, placement) -> None:
    from torch.distributed.tensor import distribute_tensor

    for owner in list(module.modules()):
        for leaf, param in list(owner._parameters.items()):
            if param is not None:
                sharded = distribute_tensor(param.detach(), tp_mesh, [placement])
                owner._parameters[leaf] = nn.Parameter(sharded, requires_grad=param.requires_grad)


def _replicate_over_sequence_shards(module: nn.Module, tp_mesh) -> None:
    """``module`` runs on this rank's sequence shard with replicated weights whose gradients sum over ``tp``."""
    from torch.distributed.tensor import Partial, Replicate

    _distribute_parameters(module, tp_mesh, Replicate())
    use_local_parameters(module, grad_placements=[Partial()])


def _shard_locally(attn: nn.Module, linears: Linears, tp_mesh) -> None:
    """Latent attention, Megatron-style: the sequence is gathered on entry; the low-rank down projections and
    their norms are replicated (the record's ``replicated``: their gradients, partial per rank, are summed);
    the up projections are split by heads and ``o_proj`` by its input rows, whose partial outputs are
    reduce-scattered back to sequence shards."""
    from torch.distributed.tensor import Shard

    low_precision = [name for name, m in attn.named_children() if is_low_precision_linear(m)]
    if low_precision:
        raise ValueError(f"tensor parallelism of FP8/MXFP8 layers in MLA attention ({', '.join(low_precision)}) is "
                         f"not supported (its projections compute on local shards, whose scales would differ); "
                         f"keep them in high precision with fp8.filter_fqns: ['attn']")
    if getattr(attn.o_proj, "base_layer", attn.o_proj).bias is not None:
        raise ValueError("tensor parallelism of MLA with an output bias (attention.out_bias) is not supported")
    group = tp_mesh.get_group()
    styles = [(name, "colwise") for name in linears.columns] + [(name, "rowwise") for name in linears.rows]
    for name, style in styles:
        if not hasattr(attn, name):
            continue
        linear = getattr(attn, name)
        if is_lora_linear(linear):
            shard_lora_locally(linear, tp_mesh, style)
        else:
            _distribute_parameters(linear, tp_mesh, Shard(0) if style == "colwise" else Shard(1))
            use_local_parameters(linear)
    attn.register_forward_pre_hook(lambda module, args: (all_gather_autograd(args[0], 1, group), *args[1:]))
    attn.register_forward_hook(lambda module, args, output: reduce_scatter_autograd(output, 1, group))


def _average_aux_loss_over(group):
    """Each rank's load-balancing loss covers its sequence shard: make it the mean over the shards (the same
    value on every rank, as the main loss is) whose gradient is this shard's share of the mean's gradient."""
    import torch.distributed as dist

    def average(moe, args, output):
        if moe.aux_loss is not None:
            share = moe.aux_loss / dist.get_world_size(group)
            mean = share.detach().clone()
            dist.all_reduce(mean, group=group)
            moe.aux_loss = share + (mean - share.detach())
        return output

    return average


class VocabParallelOutput(OutputLayer):
    """The output layer over a vocabulary split by rows across ``tp_mesh``, fed by sequence-parallel hidden
    states: they are all-gathered along the sequence (the backward reduce-scatters, summing each rank's
    partial input gradient), multiplied by the local rows, and reduced Megatron-style."""

    def __init__(self, tp_mesh, repeatable_backward: bool = False) -> None:
        self.mesh = tp_mesh
        self.group = tp_mesh.get_group()
        self.repeatable_backward = repeatable_backward

    def _full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_autograd(hidden, 1, self.group)

    def _local_rows(self, weight) -> tuple[torch.Tensor, int]:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return weight.to_local(), offset[0]

    def logits(self, hidden: torch.Tensor, weight) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        local_weight, _ = self._local_rows(weight)
        local_logits = F.linear(self._full_sequence(hidden), local_weight)
        return DTensor.from_local(local_logits, self.mesh, [Shard(-1)]).full_tensor()

    def loss(self, hidden: torch.Tensor, weight, labels: torch.Tensor, chunk_size: int,
             label_count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        local_weight, start = self._local_rows(weight)
        return linear_cross_entropy(self._full_sequence(hidden), local_weight, labels, chunk_size,
                                    vocab_group=self.group, vocab_start=start,
                                    repeatable_backward=self.repeatable_backward, label_count=label_count)


def sum_partial_gradients(model: nn.Module) -> None:
    """Without FSDP (which does it while reducing), turn the partial gradients of replicated DTensor
    parameters (norms under sequence parallelism, MoE weights) into their sums once they are accumulated, so
    optimizers and clipping see plain replicated gradients. Inside :func:`deferred_partial_sums` (the
    micro-batches before the last of a step) they stay partial: partial sums add up, and one all-reduce per
    step does for all micro-batches."""
    from torch.distributed.tensor import DTensor

    def redistribute(param) -> None:
        if not getattr(model, DEFER_FLAG, False) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    def register(module: nn.Module, args) -> None:
        # on the first forward, i.e. after materialization: ``to_empty`` swaps DTensor parameters for new
        # objects, which would drop hooks registered on the meta-device ones
        for param in module.parameters():
            if isinstance(param, DTensor) and param.requires_grad and any(p.is_replicate() for p in param.placements):
                param.register_post_accumulate_grad_hook(redistribute)
        handle.remove()

    setattr(model, DEFER_FLAG, False)
    handle = model.register_forward_pre_hook(register)


# set on a model whose partial gradients are summed by ``sum_partial_gradients``
DEFER_FLAG = "_defer_partial_gradient_sums"


@contextmanager
def deferred_partial_sums(model: nn.Module) -> Iterator[None]:
    """Backward passes run inside leave replicated parameters' gradients partial (see ``sum_partial_gradients``)."""
    previous = getattr(model, DEFER_FLAG)
    setattr(model, DEFER_FLAG, True)
    try:
        yield
    finally:
        setattr(model, DEFER_FLAG, previous)
