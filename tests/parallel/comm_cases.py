"""Worker side of the communication-accounting test: each rank builds the tiny MoE model under a layout, runs the
micro-batches of one optimizer step (forward + backward; a pipeline: three steps of ``Trainer.fit``), counts the
bytes its collectives handle (``debug/comm_bytes.py``) and compares them, by kind and the ranks of each process
group, with ``parallel.comm.model_comm_bytes``."""

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


def summed_by(sizes: dict[tuple[str, str], int], ranks_of) -> dict[tuple[str, tuple[int, ...]], int]:
    """``{(kind, ranks): bytes}``: entries whose groups span the same ranks add up (DTensor and expert
    parallelism's meshes may make several process groups over one set of ranks, and several mesh dimensions may
    share them: ``ep`` and ``fsdp``)."""
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for (kind, group), size in sizes.items():
        key = (kind, ranks_of(group))
        out[key] = out.get(key, 0) + size
    return out


def by_ranks(counted: dict[tuple[str, str], int]) -> dict[tuple[str, tuple[int, ...]], int]:
    """The counted bytes (by process group name) by the ranks of each group."""
    return summed_by(counted, lambda name: group_ranks(_resolve_process_group(name)))


def in_groups(by_dim: dict[tuple[str, str], int], dims: ParallelDims) -> dict[tuple[str, tuple[int, ...]], int]:
    """The analytic count (by mesh dimension) by the ranks of each dimension's group."""
    def ranks_of(dim: str) -> tuple[int, ...]:
        mesh = dims.mesh(dim)  # HSDP's fsdp mesh is (replicate, shard): FSDP gathers over the shard dimension
        return group_ranks(mesh.get_group(mesh.ndim - 1))

    return summed_by(by_dim, ranks_of)


def check_counts(root: str, layouts: list[dict], pipelines: list[dict]) -> None:
    """Counted = analytic for every layout (a model's forward and backward passes) and every pipeline (a fit)."""
    problems = layout_problems(layouts) + pipeline_problems(root, pipelines)
    assert not problems, "\n".join(problems)


def layout_problems(layouts: list[dict]) -> list[str]:
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
    return problems


# the training loop's own reductions (loss and token sums, finite flags, the gradient norm), which the analytic
# count leaves out: a few scalars per step
BOOKKEEPING = ("all_reduce", "broadcast")
BOOKKEEPING_BYTES = 128


def fitted_step(case: str, sizes: dict, shape: StepShape, root: str) -> tuple[dict, ParallelDims]:
    """``({(kind, ranks): bytes}, dims)`` of optimizer step 3 of a ``Trainer.fit`` of ``case`` under
    ``ParallelStrategy(**sizes)`` (pipelines run only there), counted by ``debug.comm_bytes.CommBytesCounter``."""
    import lightning as L

    from lightning_moe import ParallelStrategy
    from lightning_moe.data import MockDataModule
    from lightning_moe.debug.comm_bytes import CommBytesCounter
    from lightning_moe.modules.causal_lm import CausalLM
    from lightning_moe.modules.optim import OptimizerConfig

    counter = CommBytesCounter(report=f"{root}/comm_{{rank}}.json", step=3)
    strategy = ParallelStrategy(**sizes, pp_schedule=shape.pipeline_schedule,
                                activation_checkpointing=shape.activation_checkpointing)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=[counter])
    dims = ParallelDims(**sizes, world_size=dist.get_world_size())
    rows = shape.rows * shape.micro_batches * dims.dp_size
    data = MockDataModule(seq_length=shape.seq_len, micro_batch_size=shape.rows, global_batch_size=rows,
                          vocab_size=tiny_config(case).vocab_size, num_val_samples=0)
    trainer.fit(CausalLM(model=tiny_config(case), optimizer=OptimizerConfig(lr=1e-3)), datamodule=data)
    counted = by_ranks({key: value[1] for key, value in counter.counts.items()})
    return counted, trainer.strategy.parallel_dims


def pipeline_problems(root: str, layouts: list[dict]) -> list[str]:
    """Per layout (``case``, ``schedule``, ``micro_batches``, ``ac`` and the strategy's sizes): the bytes of every
    collective and transfer of this rank's stage equal the analytic count; what the count leaves out is only the
    loop's few-byte reductions."""
    problems = []
    for index, layout in enumerate(layouts):
        sizes = {k: v for k, v in layout.items() if k not in ("ac", "case", "schedule", "micro_batches")}
        shape = StepShape(ROWS, SEQ, layout.get("micro_batches", MICRO_BATCHES),
                          activation_checkpointing=layout.get("ac", "none"),
                          pipeline_schedule=layout.get("schedule", "1f1b"))
        counted, dims = fitted_step(layout.get("case", CASE), sizes, shape, f"{root}/{index}")
        analytic = model_comm_bytes(tiny_config(layout.get("case", CASE)), dims, shape, pp_rank=dims.pp_rank)
        expected = in_groups(analytic, dims)
        modelled = {key: size for key, size in counted.items()
                    if key in expected or key[0] not in BOOKKEEPING or size > BOOKKEEPING_BYTES}
        if modelled != expected or not any(kind == "send" for kind, _ in expected):
            problems.append(f"rank {dist.get_rank()} {layout}: counted {sorted(modelled.items())} != analytic "
                            f"{sorted(expected.items())}")
    return problems
