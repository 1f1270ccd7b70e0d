"""Whether a parallel size splits a model's heads, groups or widths evenly (with the sizes that would), and whether a
step has the micro-batches its pipeline stages need."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_head_split(n_groups: int, size: int, name: str, key: str = "mamba.n_groups",
                     unit: str = "whole B/C groups") -> None:
    if n_groups % size:
        raise ValueError(f"{name}={size} does not divide {key}={n_groups} (each {name} rank scans {unit}); "
                         f"use {name} in {divisors(n_groups)}")


def check_micro_batches(micro_batches: int, pp: int) -> None:
    """Refuse, before the first step, a micro-batch count the pipeline cannot fill."""
    if micro_batches < pp:
        raise ValueError(
            f"pp={pp} pipeline stages need at least {pp} micro-batches per step, got {micro_batches} "
            f"(global_batch_size / (micro_batch_size x data-parallel size)); raise global_batch_size to at least "
            f"{pp} x micro_batch_size x data-parallel size"
        )
