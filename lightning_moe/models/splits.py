"""Whether a parallel size splits a model's heads, groups or widths evenly, with the sizes that would."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_head_split(n_groups: int, size: int, name: str, key: str = "mamba.n_groups",
                     unit: str = "whole B/C groups") -> None:
    if n_groups % size:
        raise ValueError(f"{name}={size} does not divide {key}={n_groups} (each {name} rank scans {unit}); "
                         f"use {name} in {divisors(n_groups)}")

