"""Data-parallel rank and size: the one place data modules learn how to shard."""

from __future__ import annotations

from typing import Any


def data_parallel_rank_and_size(trainer: Any | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` for sharding data.

    Uses the strategy's ``data_parallel_rank`` / ``data_parallel_size`` when it has them (tensor-,
    context- and expert-parallel peers share one data-parallel rank and must see the same batch),
    else the strategy's ``distributed_sampler_kwargs`` (what Lightning shards its own samplers by: the
    data-parallel mesh of Lightning's ``ModelParallelStrategy``, every process under DDP or FSDP), else
    the trainer's global rank and world size, else ``(0, 1)`` without a trainer.
    """
    if trainer is None:
        return 0, 1
    strategy = getattr(trainer, "strategy", None)
    rank = getattr(strategy, "data_parallel_rank", None)
    size = getattr(strategy, "data_parallel_size", None)
    if rank is not None and size is not None:
        return int(rank), int(size)
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if kwargs and kwargs.get("num_replicas"):
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return int(trainer.global_rank), int(trainer.world_size)
