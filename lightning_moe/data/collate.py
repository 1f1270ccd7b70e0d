"""Collate rows into the package's batch format.

Every data module yields batches with:

- ``input_ids``: LongTensor [B, S].
- ``labels``: LongTensor [B, S], already shifted: ``labels[b, t]`` is the target of the prediction
  at position ``t`` (the next token), -100 where there is no loss. The model's loss does not shift.
- ``position_ids``: LongTensor [B, S], restarting at 0 at every sample start. Sample (and
  attention) boundaries are where positions restart; padding at the end of a row is its own run
  starting at 0, with ``input_ids`` = pad id and labels -100. Tokens that pad a sample to a multiple
  of ``pad_seq_to_mult`` continue that sample's positions (they belong to it, with labels -100).
- ``num_label_tokens``: 0-d LongTensor, ``(labels != -100).sum()`` over the micro-batch.
- ``layout``: a :class:`~lightning_moe.models.batch_layout.BatchLayout` of the same rows, on the host: what the
  step needs to know about them (packed or not, sequence lengths, label counts) without reading the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lightning_moe.data.formats import IGNORE_INDEX
from lightning_moe.data.packing import round_up
from lightning_moe.models.batch_layout import BatchLayout


def collate_rows(rows: Sequence[dict[str, np.ndarray]], pad_id: int, pad_to: int | None = None,
                 pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor | BatchLayout]:
    """Stack rows (``input_ids``, ``labels``, ``position_ids`` 1-D arrays) into a padded batch.

    Rows are padded to ``pad_to`` (fixed packed size) or, when None, to the longest row rounded up to
    ``pad_to_multiple_of``.
    """
    longest = max(len(r["input_ids"]) for r in rows)
    width = pad_to if pad_to is not None else round_up(longest, pad_to_multiple_of)
    if longest > width:
        raise ValueError(f"a row has {longest} tokens, more than the batch width {width}")
    b = len(rows)
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty((b, width), dtype=np.int64)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = r["input_ids"]
        labels[i, :n] = r["labels"]
        position_ids[i, :n] = r["position_ids"]
        position_ids[i, n:] = np.arange(width - n)
    labels_t = torch.from_numpy(labels)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": labels_t,
        "position_ids": torch.from_numpy(position_ids),
        "num_label_tokens": (labels_t != IGNORE_INDEX).sum(),
        "layout": BatchLayout(position_ids.copy(), labels.copy()),  # the tensors share these arrays
    }


class Collator:
    """Picklable collate function (DataLoader workers need one)."""

    def __init__(self, pad_id: int, pad_to: int | None = None, pad_to_multiple_of: int = 1) -> None:
        self.pad_id, self.pad_to, self.pad_to_multiple_of = pad_id, pad_to, pad_to_multiple_of

    def __call__(self, rows: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor | BatchLayout]:
        return collate_rows(rows, self.pad_id, self.pad_to, self.pad_to_multiple_of)
