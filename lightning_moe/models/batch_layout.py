"""A micro-batch's layout as host values: where its sequences start and end, and which tokens carry a label.

The data pipeline (``data/collate.py``) builds one per micro-batch from the numpy arrays it collates, and it
travels with the batch under ``"layout"``; Lightning leaves it on the host when it moves the batch to the device
(it has no ``.to``). The model, the loss and the callbacks read from it what they would otherwise read back from
device tensors, each read a host sync on a GPU: whether rows are packed, ``cu_seqlens`` and the longest
sequence, label-token counts (the fused loss selects the labelled rows with a count known in advance), and the
inputs of the FLOP count. Everything is computed on first use, in numpy.

Under context parallelism :meth:`BatchLayout.shard` keeps the whole rows and notes the columns this rank holds:
per-rank figures (``packed``, ``cu_seqlens``, label counts) are of those columns, MTP targets still come from the
whole row, as the model takes them.
"""

from __future__ import annotations

import numpy as np

from lightning_moe.models.layers.loss import IGNORE_INDEX


def shift_left(x: np.ndarray, steps: int, fill: int) -> np.ndarray:
    """``x[:, t + steps]`` at position ``t``; the last ``steps`` positions get ``fill``."""
    out = np.full_like(x, fill)
    out[:, :-steps] = x[:, steps:]
    return out


def sequence_bounds(positions: np.ndarray) -> np.ndarray:
    """Flat indices of ``positions`` ([batch, seq]) where a sequence starts (a position of 0, or a row's first
    token), then its size: the cumulative sequence lengths of the flattened rows."""
    starts = positions == 0
    starts[:, 0] = True
    return np.append(np.flatnonzero(starts), positions.size)


class BatchLayout:
    """``position_ids`` and ``labels`` ([batch, seq] int64 numpy arrays; labels pre-shifted, -100 without loss) of
    whole rows; ``columns``: the sequence positions this rank holds (all of them when None)."""

    __slots__ = ("position_ids", "labels", "columns", "_cache")

    def __init__(self, position_ids: np.ndarray, labels: np.ndarray | None = None,
                 columns: np.ndarray | None = None) -> None:
        self.position_ids = np.asarray(position_ids)
        self.labels = None if labels is None else np.asarray(labels)
        self.columns = columns
        self._cache: dict = {}

    def __repr__(self) -> str:
        return f"BatchLayout(shape={self.position_ids.shape}, packed={self.packed})"

    @property
    def shape(self) -> tuple[int, int]:
        """[batch, seq] of this rank's columns."""
        rows, seq = self.position_ids.shape
        return rows, seq if self.columns is None else len(self.columns)

    def shard(self, columns: np.ndarray) -> BatchLayout:
        """The layout of this rank's columns of every row (context parallelism)."""
        return BatchLayout(self.position_ids, self.labels, np.asarray(columns))

    def _local(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.columns is None else rows[:, self.columns]

    def _cached(self, key, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @property
    def packed(self) -> bool:
        """Some row of this rank's columns holds more than one sequence (a position restarts at 0)."""
        return self._cached("packed", lambda: bool((self._local(self.position_ids)[:, 1:] == 0).any()))

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Cumulative sequence lengths over this rank's flattened columns (int32), the varlen kernels' format."""
        return self._cached("cu_seqlens", lambda: sequence_bounds(self._local(self.position_ids)).astype(np.int32))

    @property
    def max_length(self) -> int:
        """The longest sequence of this rank's columns."""
        return self._cached("max_length", lambda: int(np.diff(self.cu_seqlens).max()))

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Lengths of every sequence of the whole rows, in order (int64): what the FLOP count runs over."""
        return self._cached("sequence_lengths", lambda: np.diff(sequence_bounds(self.position_ids)).astype(np.int64))

    def _documents(self) -> np.ndarray:
        positions = self.position_ids
        return np.cumsum(positions == 0, axis=1) - (positions[:, :1] == 0)

    def _targets(self, depth: int) -> np.ndarray:
        """Labels of the whole rows ``depth`` tokens ahead (MTP depth ``depth``; 0: the main head), -100 across a
        sequence boundary."""
        if depth == 0:
            return self.labels
        docs = self._documents()
        target = shift_left(self.labels, depth, IGNORE_INDEX)
        return np.where(shift_left(docs, depth, -1) == docs, target, IGNORE_INDEX)

    def label_tokens(self, depth: int = 0) -> int:
        """Tokens of this rank's columns whose target ``depth`` tokens ahead has a label (0: the main head)."""
        return self._cached(("labels", depth), lambda: int((self._local(self._targets(depth)) != IGNORE_INDEX).sum()))

    def output_token_counts(self, depths: int) -> list[int]:
        """Tokens each output head scores over the whole rows: the main head's labelled tokens, then for each MTP
        depth those whose target that far ahead is labelled and in the same sequence."""
        return [int((self._targets(d) != IGNORE_INDEX).sum()) for d in range(depths + 1)]
