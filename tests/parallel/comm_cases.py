"""Worker side of the communication-accounting test: each rank builds the tiny MoE model under a layout, runs the
micro-batches of one optimizer step (forward + backward), counts the bytes its collectives handle
(``debug/comm_bytes.py``) and compares them, by kind and mesh dimension, with ``parallel.comm.model_comm_bytes``."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from parallel_cases import initial_state, local_batch, parallel_model, tiny_config
from torch.distributed.distributed_c10d import _resolve_process_group

from lightning_moe.debug.comm_bytes import count_comm_bytes, group_ranks
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.comm import StepShape, model_comm_bytes
from lightning_moe.parallel.fsdp import deferred_all_reduce
from lightning_moe.parallel.tensor import DEFER_FLAG, deferred_partial_sums

ROWS, SEQ, MICRO_BATCHES = 2, 16, 2
CASE = "qwen3_moe_balanced"  # balanced routing: the exchanged token counts are known in advance


def deferred(model: torch.nn.Module, dims: ParallelDims):
    """What ``ParallelStrategy.block_backward_sync`` runs a micro-batch before the last of a step inside."""
    if hasattr(model, DEFER_FLAG):
        return deferred_partial_sums(model)
    return deferred_all_reduce(model) if dims.dp_replicate > 1 else nullcontext()


def counted_step(dims: ParallelDims, shape: StepShape, case: str = CASE) -> dict[tuple[str, str], int]:
    """``{(kind, process group name): bytes}`` of the step's collectives on this rank: each micro-batch's rows of
    the data-parallel ranks (and sequence shard of the context-parallel ones), every token labelled."""
    model = parallel_model(case, dims, initial_state(case), activation_checkpointing=shape.activation_checkpointing)
    gen = torch.Generator().manual_seed(0)
    with count_comm_bytes() as counts:
        for index in range(shape.micro_batches):
            ids = torch.randint(0, model.config.vocab_size, (shape.rows * dims.dp_size, shape.seq_len), generator=gen)
            batch = local_batch({"input_ids": ids, "labels": ids}, dims)
            last = index == shape.micro_batches - 1
            with nullcontext() if last else deferred(model, dims):
                out = model(batch["input_ids"], batch.get("position_ids"), labels=batch["labels"])
                out.loss_sum.backward()
    return {key: value[1] for key, value in counts.items()}


def by_ranks(counted: dict[tuple[str, str], int]) -> dict[tuple[str, tuple[int, ...]], int]:
    """The counted bytes by the ranks of each process group: DTensor and expert parallelism's meshes may make
    several groups over the same ranks."""
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for (kind, group), size in counted.items():
        key = (kind, group_ranks(_resolve_process_group(group)))
        out[key] = out.get(key, 0) + size
    return out


def in_groups(by_dim: dict[tuple[str, str], int], dims: ParallelDims) -> dict[tuple[str, tuple[int, ...]], int]:
    """The analytic count by the ranks of each mesh dimension: dimensions over the same ranks (``ep`` and
    ``fsdp``) add up there."""
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for (kind, dim), size in by_dim.items():
        mesh = dims.mesh(dim)  # HSDP's fsdp mesh is (replicate, shard): FSDP gathers over the shard dimension
        key = (kind, group_ranks(mesh.get_group(mesh.ndim - 1)))
        out[key] = out.get(key, 0) + size
    return out


def check_layouts(layouts: list[dict]) -> None:
    problems = []
    for layout in layouts:
        sizes = {k: v for k, v in layout.items() if k not in ("ac", "case")}
        ac, case = layout.get("ac", "none"), layout.get("case", CASE)
        dims = ParallelDims(**sizes, world_size=dist.get_world_size())
        dims.build_meshes("cpu")
        shape = StepShape(ROWS, SEQ, MICRO_BATCHES, activation_checkpointing=ac)
        analytic = model_comm_bytes(tiny_config(case), dims, shape)
        counted, expected = by_ranks(counted_step(dims, shape, case)), in_groups(analytic, dims)
        if counted != expected or not analytic:
            problems.append(f"rank {dist.get_rank()} {layout}: counted {sorted(counted.items())} != analytic "
                            f"{sorted(analytic.items())}")
    assert not problems, "\n".join(problems)
