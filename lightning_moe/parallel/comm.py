"""Bytes the model's collectives move per optimizer step, from the model config and the parallel layout.

What one rank's collectives handle in one optimizer step of ``micro_batches`` forward + backward passes (the bytes
of each call as :mod:`lightning_moe.debug.comm_bytes` counts them: an all-gather's gathered output, a
reduce-scatter's input, an all-to-all's input), by kind and mesh dimension:

- FSDP2 (``fsdp`` mesh; the experts of expert-parallel MoE layers on ``expert_fsdp``): per micro-batch and FSDP
  unit (each block, each MTP depth, the root with the embedding, final norm and output layer) one all-gather in
  forward, one more in backward for the blocks (they are resharded after forward, the root is not), and one
  reduce-scatter of the gradients (none over a mesh of one rank). A parameter's shard is ``ceil(rows / ranks)``
  rows of it (FSDP pads the last); all-gathers move ``param_dtype``, reduce-scatters ``reduce_dtype``.
- Expert parallelism (``ep`` mesh), per MoE layer and micro-batch: the per-expert counts (int64), the token copies
  out and the expert outputs back, and both again in backward; a checkpointed block runs its forward again in
  backward, the copies' exchanges included (the counts are not exchanged again: ``parallel/expert.py``). Token
  traffic is exact for balanced routing (``moe.force_balanced``, the benchmarks' setting): each rank then receives
  as many copies as it sends.

Not counted yet (refused by name): tensor, context and pipeline parallelism, HSDP replicas.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.layers.moe import MoE
from lightning_moe.parallel.activation_checkpoint import checkpointed_blocks, repeated_blocks


@dataclass(frozen=True)
class StepShape:
    """One rank's micro-batches of an optimizer step and the dtypes they run in."""

    rows: int  # rows of each micro-batch on this rank
    seq_len: int
    micro_batches: int = 1
    dtype: torch.dtype = torch.float32  # of the parameters and activations
    param_dtype: torch.dtype | None = None  # FSDP's mixed-precision policy (None: the parameters' dtype)
    reduce_dtype: torch.dtype | None = torch.float32
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1


def _shard_bytes(params: list[nn.Parameter], ranks: int, element_size: int, expert_split: int = 1) -> int:
    """Bytes of the whole padded tensor FSDP gathers from ``ranks`` shards (``expert_split``: the leading dimension
    is already divided by expert parallelism)."""
    numel = 0
    for param in params:
        rows = param.shape[0] // expert_split if param.dim() else 1
        numel += ranks * math.ceil(rows / ranks) * (param[0].numel() if param.dim() else 1)
    return numel * element_size


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def model_comm_bytes(config: ModelConfig, dims, shape: StepShape) -> dict[tuple[str, str], int]:
    """``{(kind, mesh dimension): bytes}`` this rank's collectives handle per optimizer step (module docstring)."""
    for name, size in (("tp", dims.tp), ("cp", dims.cp), ("pp", dims.pp), ("dp_replicate", dims.dp_replicate)):
        if size > 1:
            raise NotImplementedError(f"model_comm_bytes: {name}={size} is not counted yet (fsdp and ep are)")
    with torch.device("meta"):
        model = Decoder(config)
    total: dict[tuple[str, str], int] = defaultdict(int)
    m = shape.micro_batches
    fsdp_ranks = dims.dp_shard * dims.cp
    if fsdp_ranks > 1:
        gather = _element_size(shape.param_dtype or shape.dtype)
        reduce = _element_size(shape.reduce_dtype or shape.param_dtype or shape.dtype)
        expert_ranks = dims.ep_shard
        in_blocks = set()
        for _, block in repeated_blocks(model):
            experts = [p for moe in block.modules() if isinstance(moe, MoE) for p in moe.experts.parameters()]
            expert_ids = {id(p) for p in experts} if dims.ep > 1 else set()
            dense = [p for p in block.parameters() if id(p) not in expert_ids]
            in_blocks.update(id(p) for p in block.parameters())
            units = [("fsdp", dense, fsdp_ranks, 1)]
            if expert_ids:
                units.append(("expert_fsdp", experts, expert_ranks, dims.ep))
            for mesh, params, ranks, split in units:
                if ranks == 1:  # FSDP gathers and reduces nothing over one rank
                    continue
                total[("all_gather", mesh)] += 2 * m * _shard_bytes(params, ranks, gather, split)
                total[("reduce_scatter", mesh)] += m * _shard_bytes(params, ranks, reduce, split)
        root = [p for p in model.parameters() if id(p) not in in_blocks]
        total[("all_gather", "fsdp")] += m * _shard_bytes(root, fsdp_ranks, gather)
        total[("reduce_scatter", "fsdp")] += m * _shard_bytes(root, fsdp_ranks, reduce)
    if dims.ep > 1:
        checkpointed = {id(block) for _, block in checkpointed_blocks(
            model, shape.activation_checkpointing, shape.activation_checkpointing_every)}
        tokens = shape.rows * shape.seq_len
        for _, block in repeated_blocks(model):
            for moe in (mod for mod in block.modules() if isinstance(mod, MoE)):
                copies = tokens * moe.cfg.top_k * (moe.cfg.latent_size or config.hidden_size) * _element_size(shape.dtype)
                passes = 3 if id(block) in checkpointed else 2  # forward, (recomputed forward,) backward
                total[("all_to_all", "ep")] += m * (8 * moe.cfg.num_experts + passes * 2 * copies)
    return dict(total)
