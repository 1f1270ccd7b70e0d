"""Parallelism: one named set of meshes (``ParallelDims``), one options dataclass (``ParallelOptions``), one
``parallelize`` that applies tensor, expert and context parallelism, activation checkpointing and FSDP2/HSDP to
any model kind (``model_kind.py``), and the Lightning strategy that ties them to a Trainer (``ParallelStrategy``). Each parallelism's whole story is one file of this package."""

from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.parallelize import parallelize
from lightning_moe.parallel.strategy import ParallelStrategy

__all__ = ["ParallelDims", "ParallelOptions", "ParallelStrategy", "parallelize"]
