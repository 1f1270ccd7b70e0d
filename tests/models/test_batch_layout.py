"""The host layout of a batch (``BatchLayout``) says what the device tensors say: packed rows, ``cu_seqlens``,
label counts (main head and MTP depths, whole rows and context-parallel columns); the fused loss given the count
selects the same rows as ``nonzero`` and gives bitwise the same loss and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.layers.loss import IGNORE_INDEX, labelled_rows, linear_cross_entropy
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.parallel.context import balanced_columns


def _batch(lengths: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = torch.randint(0, 50, positions.shape, generator=gen)
    labels[torch.rand(positions.shape, generator=gen) < 0.3] = IGNORE_INDEX
    return positions, labels


def _mtp_count(positions: torch.Tensor, labels: torch.Tensor, depth: int, columns=None) -> int:
    """The MTP target rule of layers/mtp.py, on the device tensors."""
    from lightning_moe.models.layers.mtp import shift_left

    docs = SequenceLayout(positions, packed=True).document_ids
    target = shift_left(labels, depth, IGNORE_INDEX).masked_fill(shift_left(docs, depth, -1) != docs, IGNORE_INDEX)
    target = target if columns is None else target[:, torch.from_numpy(columns)]
    return int((target != IGNORE_INDEX).sum())


@pytest.mark.parametrize("lengths", [[[16], [16]], [[5, 7, 4], [10, 6]]], ids=["unpacked", "packed"])
def test_host_layout_equals_the_device_tensors(lengths):
    positions, labels = _batch(lengths)
    host = BatchLayout(positions.numpy(), labels.numpy())
    device = SequenceLayout(positions)
    assert host.packed == device.packed
    assert np.array_equal(host.cu_seqlens, device.cu_seqlens.numpy())
    assert host.max_length == int(device.cu_seqlens.diff().max())
    assert host.label_tokens() == int((labels != IGNORE_INDEX).sum())
    for depth in (1, 2):
        assert host.label_tokens(depth) == _mtp_count(positions, labels, depth)
    assert host.output_token_counts(2) == [host.label_tokens(d) for d in range(3)]
    # the context-parallel shard of rank 1 of 2: this rank's columns, MTP targets from the whole rows
    columns = balanced_columns(16, 2, 1)
    shard = host.shard(columns)
    local = SequenceLayout(positions[:, torch.from_numpy(columns)])
    assert shard.packed == local.packed
    assert np.array_equal(shard.cu_seqlens, local.cu_seqlens.numpy())
    assert shard.label_tokens() == int((labels[:, torch.from_numpy(columns)] != IGNORE_INDEX).sum())
    assert shard.label_tokens(1) == _mtp_count(positions, labels, 1, columns)
    assert shard.sequence_lengths.tolist() == host.sequence_lengths.tolist()  # FLOPs count the whole rows


def test_labelled_rows_without_nonzero():
    _, labels = _batch([[7, 9], [16]], seed=3)
    flat = labels.flatten()
    count = int((flat != IGNORE_INDEX).sum())
    assert torch.equal(labelled_rows(flat, count), torch.nonzero(flat != IGNORE_INDEX, as_tuple=True)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_with_a_host_count_is_bitwise_the_same(dtype):
    gen = torch.Generator().manual_seed(1)
    _, labels = _batch([[9, 7], [16]], seed=1)
    hidden = torch.randn(2, 16, 8, generator=gen, dtype=dtype)
    weight = torch.randn(50, 8, generator=gen, dtype=dtype)
    results = []
    for count in (None, int((labels != IGNORE_INDEX).sum())):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, tokens = linear_cross_entropy(h, w, labels, chunk_size=5, label_count=count)
        loss.backward()
        results.append((loss, tokens, h.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
