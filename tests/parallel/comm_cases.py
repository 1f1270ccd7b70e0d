"""Worker side of the communication-accounting test: each rank builds the tiny MoE model under a layout, runs the
micro-batches of one optimizer step (forward + backward), counts the bytes its collectives handle
(``debug/comm_bytes.py``) and compares them, by kind and mesh dimension, with ``parallel.comm.model_comm_bytes``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_cases import initial_state, parallel_model, tiny_config

from lightning_moe.debug.comm_bytes import count_comm_bytes
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.comm import StepShape, model_comm_bytes

ROWS, SEQ, MICRO_BATCHES = 2, 16, 2
CASE = "qwen3_moe_balanced"  # balanced routing: the exchanged token counts are known in advance


def counted_step(dims: ParallelDims, shape: StepShape) -> dict[tuple[str, str], int]:
    """``{(kind, process group name): bytes}`` of the step's collectives on this rank."""
    model = parallel_model(CASE, dims, initial_state(CASE), activation_checkpointing=shape.activation_checkpointing)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with count_comm_bytes() as counts:
        for _ in range(shape.micro_batches):
            ids = torch.randint(0, model.config.vocab_size, (shape.rows, shape.seq_len), generator=gen)
            model(ids, labels=ids).loss_sum.backward()
    return {key: value[1] for key, value in counts.items()}


def in_groups(by_dim: dict[tuple[str, str], int], dims: ParallelDims) -> dict[tuple[str, str], int]:
    """The analytic count by process group: mesh dimensions that share a group (``ep`` and ``fsdp`` on the same
    ranks) add up there."""
    out: dict[tuple[str, str], int] = {}
    for (kind, dim), size in by_dim.items():
        key = (kind, dims.mesh(dim).get_group().group_name)
        out[key] = out.get(key, 0) + size
    return out


def check_layouts(layouts: list[dict]) -> None:
    config = tiny_config(CASE)
    problems = []
    for layout in layouts:
        sizes, ac = {k: v for k, v in layout.items() if k != "ac"}, layout.get("ac", "none")
        dims = ParallelDims(**sizes, world_size=dist.get_world_size())
        dims.build_meshes("cpu")
        shape = StepShape(ROWS, SEQ, MICRO_BATCHES, activation_checkpointing=ac)
        analytic = model_comm_bytes(config, dims, shape)
        counted, expected = counted_step(dims, shape), in_groups(analytic, dims)
        if counted != expected or not analytic:
            problems.append(f"rank {dist.get_rank()} {layout}: counted {sorted(counted.items())} != analytic "
                            f"{sorted(analytic.items())}")
    assert not problems, "\n".join(problems)
