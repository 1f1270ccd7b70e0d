"""Bin packing of variable-length samples into fixed-size rows.

``pack_first_fit_decreasing`` sorts samples longest first and puts each into the first row with
room, found in O(log N) with a max segment tree over the rows' free space: O(N log N) overall.
``pack_greedy`` is the in-order baseline (a new row whenever the next sample does not fit).
Both return lists of sample indices, one list per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


def round_up(length: int, multiple: int) -> int:
    """``length`` padded up to a multiple of ``multiple`` (context/sequence parallel need it)."""
    return -(-length // multiple) * multiple


def pack_first_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit-decreasing packing. Every length must be in ``[1, capacity]``.

    Ties keep dataset order (stable sort), so the result is deterministic.
    """
    lens = _check_lengths(lengths, capacity)
    n = len(lens)
    if n == 0:
        return []
    order = np.argsort(-lens, kind="stable")
    size = 1
    while size < n:
        size *= 2
    # tree[1] is the root; leaves tree[size + b] hold the free space of row b. Rows not opened yet
    # have full capacity, so the leftmost fitting leaf is either an open row or the next new row.
    tree = [capacity] * (2 * size)
    bins: list[list[int]] = []
    for item, length in zip(order.tolist(), lens[order].tolist()):
        node = 1
        while node < size:
            node *= 2
            if tree[node] < length:
                node += 1
        b = node - size
        if b == len(bins):
            bins.append([item])
        else:
            bins[b].append(item)
        tree[node] -= length
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            new = left if left > right else right
            if tree[node] == new:
                break
            tree[node] = new
            node //= 2
    return bins


def pack_greedy(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """In-order greedy packing: append to the current row, open a new one when the sample does not fit."""
    lens = _check_lengths(lengths, capacity)
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, length in enumerate(lens.tolist()):
        if used + length > capacity:
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        bins.append(current)
    return bins


def pack_unpacked(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """One sample per row (no packing), in dataset order."""
    lens = _check_lengths(lengths, capacity)
    return [[i] for i in range(len(lens))]


PACKERS = {"ffd": pack_first_fit_decreasing, "greedy": pack_greedy, "none": pack_unpacked}


@dataclass
class PackingStats:
    """Summary written to the packed dataset's metadata JSON."""

    packed_sequence_size: int
    num_samples: int
    num_packs: int
    packing_efficiency: float  # sample tokens (after pad-to-multiple) / (num_packs * packed_sequence_size)
    packing_factor: float  # samples per pack
    max_samples_per_pack: int

    def to_dict(self) -> dict:
        return asdict(self)


def packing_stats(bins: list[list[int]], lengths: Sequence[int] | np.ndarray, capacity: int) -> PackingStats:
    lens = np.asarray(lengths, dtype=np.int64)
    used = int(sum(int(lens[b].sum()) for b in bins)) if bins else 0
    num = sum(len(b) for b in bins)
    return PackingStats(
        packed_sequence_size=capacity, num_samples=num, num_packs=len(bins),
        packing_efficiency=used / (len(bins) * capacity) if bins else 0.0,
        packing_factor=num / len(bins) if bins else 0.0,
        max_samples_per_pack=max((len(b) for b in bins), default=0),
    )


def _check_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    if capacity <= 0:
        raise ValueError(f"packed_sequence_size must be positive, got {capacity}")
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1:
        raise ValueError("lengths must be a 1-D sequence")
    if len(lens) and (lens.min() < 1 or lens.max() > capacity):
        bad = int(np.flatnonzero((lens < 1) | (lens > capacity))[0])
        raise ValueError(f"sample {bad} has length {int(lens[bad])}, outside [1, {capacity}]; "
                         "drop or truncate over-long samples before packing")
    return lens
