"""GPT-style sampling over Megatron indexed data: documents, epochs, splits and blends.

As in Megatron-Core's ``GPTDataset``: a split is a contiguous range of sequences (documents, in text
data), tiled over as many epochs as the samples need, shuffled with a seeded RNG and concatenated;
sample ``j`` is tokens ``[j * S, j * S + S + 1)`` of that stream (so consecutive samples overlap by one
token and cross document boundaries); samples are shuffled once more. Unlike Megatron, which shuffles
all epochs' documents together, each epoch is its own permutation: every document once per epoch.
The RNGs differ from Megatron's, so the order is not Megatron's sample for sample. ``input_ids = text[:-1]`` and ``labels = text[1:]`` are the package's shifted labels.
With ``reset_at_eod`` positions restart after every EOD token, which also separates attention
(boundaries are where positions restart); the label at an EOD position (the next document's first
token) is kept unless ``eod_mask_loss``.

With a ``cache_dir`` the index arrays (document order, document offsets, sample shuffle) are written once, as
``.npy`` files named by a hash of everything they depend on, and memory-mapped: the ranks of a node share one
copy instead of each building and holding its own (as Megatron-Core's ``path_to_cache``).

Blends follow Megatron's formats: ``["30", "path_a", "70", "path_b"]`` (weights normalized),
``[["path_a", "path_b"], None]`` or ``[["path_a", "path_b"], [0.3, 0.7]]``, or one path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_moe.data.array_cache import cached_arrays
from lightning_moe.data.formats import IGNORE_INDEX
from lightning_moe.data.indexed import IndexedDataset


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized ``[train, valid, test]`` fractions (missing parts are 0)."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"split {split!r}: expected up to three comma-separated numbers like '969,30,1'")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r}: every part must be a number") from None
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r}: parts must be non-negative with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(num_sequences: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous sequence ranges per split, as megatron-core bounds them: each split runs from
    ``round(start * N)`` to ``round(end * N)`` of its cumulative fractions ``[start, end)`` over the ``N``
    sequences (GPT data is split by sequence, not by document)."""
    bounds, total = [0], 0.0
    for f in fractions:
        total += f
        bounds.append(int(round(total * float(num_sequences))))
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def parse_blend(blend: Any) -> tuple[list[str], list[float]]:
    """Normalize a blend to ``(prefixes, weights)`` with weights summing to 1."""
    if isinstance(blend, str):
        return [blend], [1.0]
    if isinstance(blend, (tuple, list)) and len(blend) == 2 and isinstance(blend[0], (list, tuple)):
        prefixes, weights = list(blend[0]), blend[1]
        if weights is None:
            weights = [1.0] * len(prefixes)
        if not isinstance(weights, (list, tuple)) or len(weights) != len(prefixes):
            raise ValueError(f"blend: {len(prefixes)} paths but weights {weights!r}")
        return _normalize(prefixes, [_weight(w, i) for i, w in enumerate(weights)])
    if not isinstance(blend, (list, tuple)) or not blend:
        raise ValueError(f"blend must be a path, a list like ['30', 'a', '70', 'b'] or [['a', 'b'], None]; "
                         f"got {blend!r}")
    if len(blend) == 1:
        return [str(blend[0])], [1.0]
    if len(blend) % 2:
        raise ValueError(f"blend {blend!r}: expected weight, path pairs (even length)")
    weights = [_weight(w, 2 * i) for i, w in enumerate(blend[0::2])]
    return _normalize([str(p) for p in blend[1::2]], weights)


def _weight(w: Any, position: int) -> float:
    try:
        value = float(w)
    except (TypeError, ValueError):
        raise ValueError(f"blend: weight {w!r} at position {position} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"blend: weight {w!r} at position {position} must be a non-negative number")
    return value


def _normalize(prefixes: list[str], weights: list[float]) -> tuple[list[str], list[float]]:
    total = sum(weights)
    if total <= 0:
        raise ValueError("blend: weights sum to zero")
    return prefixes, [w / total for w in weights]


class GPTDataset:
    """Fixed-length samples over the sequences ``sequence_range`` of an indexed dataset (one sequence per
    document in text data; like Megatron, sequences are what is shuffled and split).

    Args:
        indexed: the :class:`IndexedDataset`.
        seq_length: tokens per sample (each sample reads ``seq_length + 1``).
        num_samples: samples wanted; epochs are added until there are enough. None: one epoch.
        seed: seed of the document and sample shuffles.
        sequence_range: ``[first, last)`` sequence indices of this split (default: all).
        reset_at_eod: restart positions (and so attention) after every ``eod_token_id``.
        eod_token_id: end-of-document token (needed for ``reset_at_eod`` / ``eod_mask_loss``).
        eod_mask_loss: no loss at positions whose input is the EOD token.
        shuffle: shuffle documents and samples (else stream order).
        cache_dir: where the index arrays are cached and memory-mapped from (None: built in memory).
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, num_samples: int | None = None, seed: int = 1234,
                 sequence_range: tuple[int, int] | None = None, reset_at_eod: bool = False,
                 eod_token_id: int | None = None, eod_mask_loss: bool = False, shuffle: bool = True,
                 cache_dir: str | None = None) -> None:
        if (reset_at_eod or eod_mask_loss) and eod_token_id is None:
            raise ValueError("reset_at_eod / eod_mask_loss need eod_token_id")
        self.indexed, self.seq_length = indexed, seq_length
        self.reset_at_eod, self.eod_token_id, self.eod_mask_loss = reset_at_eod, eod_token_id, eod_mask_loss
        s0, s1 = sequence_range if sequence_range is not None else (0, len(indexed))
        seq_ids = np.arange(s0, s1, dtype=np.int64)
        lengths = indexed.sequence_lengths[seq_ids].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch < seq_length + 1:
            raise ValueError(f"{indexed.path_prefix}: sequences {s0}..{s1} hold {tokens_per_epoch} tokens, "
                             f"fewer than one sample of {seq_length + 1}")
        per_epoch = (tokens_per_epoch - 1) // seq_length
        if num_samples is None:
            num_samples = per_epoch
        num_epochs = 1
        while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
            num_epochs += 1
        self.num_samples, self.num_epochs = num_samples, num_epochs
        description = {
            "prefix": os.path.realpath(indexed.path_prefix), "sequences": len(indexed), "range": [s0, s1],
            "tokens": tokens_per_epoch, "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
            "shuffle": shuffle, "version": INDEX_CACHE_VERSION,
        }

        def build() -> dict[str, np.ndarray]:
            rng = np.random.default_rng(seed)
            orders = [rng.permutation(seq_ids) if shuffle else seq_ids for _ in range(num_epochs)]
            doc_order = np.concatenate(orders)
            doc_lengths = indexed.sequence_lengths[doc_order].astype(np.int64)
            return {
                "doc_order": doc_order,
                "doc_starts": np.concatenate([[0], np.cumsum(doc_lengths)]),  # stream offset of each document
                "shuffle_index": rng.permutation(num_samples) if shuffle else np.arange(num_samples),
            }

        arrays = build() if cache_dir is None else cached_arrays(cache_dir, "gpt", description, build)
        self.doc_order, self.doc_starts, self.shuffle_index = (
            arrays["doc_order"], arrays["doc_starts"], arrays["shuffle_index"])

    def __len__(self) -> int:
        return self.num_samples

    def text(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``i``."""
        start = int(self.shuffle_index[i]) * self.seq_length
        end = start + self.seq_length + 1
        k = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        parts = []
        while start < end:
            doc_end = int(self.doc_starts[k + 1])
            take = min(end, doc_end) - start
            parts.append(self.indexed.get(int(self.doc_order[k]), start - int(self.doc_starts[k]), take))
            start += take
            k += 1
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        text = self.text(i)
        tokens, labels = text[:-1], text[1:].copy()
        positions = np.arange(self.seq_length)
        if self.reset_at_eod or self.eod_mask_loss:
            eod = tokens == self.eod_token_id
            if self.eod_mask_loss:
                labels[eod] = IGNORE_INDEX
            if self.reset_at_eod:
                # a new segment starts after each EOD: positions count from the last segment start
                starts = np.zeros(self.seq_length, dtype=np.int64)
                after = np.flatnonzero(eod[:-1]) + 1
                starts[after] = after
                positions = positions - np.maximum.accumulate(starts)
        return {"input_ids": tokens, "labels": labels, "position_ids": positions}


INDEX_CACHE_VERSION = 1


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of length ``size`` interleaving datasets by weight.

    Dataset ``k``'s ``j``-th sample is placed at "time" ``(j + 0.5) / w_k`` and all samples are taken
    in time order (stride scheduling), so every prefix of the blend holds each dataset's share to within
    ``0.5 + K / 2`` samples for ``K`` datasets (not Megatron's greedy order, the same proportions).
    """
    w = np.asarray(weights, dtype=np.float64)
    times, ids, counts = [], [], []
    for k, (wk, n) in enumerate(zip(w, blended_samples_needed(weights, size))):
        if n == 0:
            continue
        times.append((np.arange(n) + 0.5) / wk)
        ids.append(np.full(n, k, dtype=np.int64))
        counts.append(np.arange(n, dtype=np.int64))
    order = np.argsort(np.concatenate(times), kind="stable")[:size]
    return np.concatenate(ids)[order], np.concatenate(counts)[order]


class BlendedDataset:
    """Several datasets mixed by weight; ``len() == size``. With ``cache_dir`` the blend's index arrays are
    cached and memory-mapped as :class:`GPTDataset`'s are."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int,
                 cache_dir: str | None = None) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.weights, self.size = list(datasets), list(weights), size

        def build() -> dict[str, np.ndarray]:
            dataset_index, sample_index = blending_indices(weights, size)
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        description = {"weights": list(map(float, weights)), "size": size, "version": INDEX_CACHE_VERSION}
        arrays = build() if cache_dir is None else cached_arrays(cache_dir, "blend", description, build)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for k, ds in enumerate(self.datasets):
            need = int((self.dataset_index == k).sum())
            if need > len(ds):
                raise ValueError(f"blend member {k} has {len(ds)} samples but the blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def blended_samples_needed(weights: Sequence[float], size: int) -> list[int]:
    """Samples each member must provide for a blend of ``size`` (what :func:`blending_indices` may use)."""
    return [int(math.ceil(w * size)) + 1 if w > 0 else 0 for w in weights]
