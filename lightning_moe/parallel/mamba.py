"""Mamba-2 mixers on ranks that each hold part of every row (context parallelism, or tensor parallelism's
sequence shards): the scan runs through a whole sequence, so it cannot be split by tokens, but heads are
independent. Each rank projects its own tokens (``in_proj``), an all-to-all trades tokens for heads: every rank
then holds the whole row for ``n_groups / n`` of the B/C groups and their heads, and runs the conv, scan and
gated norm there, on the row in its natural order. A second all-to-all trades back before ``out_proj``. This is
Megatron-Core's all-to-all context parallelism for Mamba. The mixer's weights are whole on every rank (each
uses its heads' slices; their gradients are summed over the group). The gated delta rule mixers (Gated
DeltaNet: whole key heads with their value heads; KDA: whole heads) run the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.parallel.collectives import all_to_all_autograd

RowOrder = Callable[[SequenceLayout], tuple[torch.Tensor | None, SequenceLayout]]


def _take(part: torch.Tensor, channels: slice | torch.Tensor) -> torch.Tensor:
    return part[..., channels] if isinstance(channels, slice) else part.index_select(-1, channels)


def _width(channels: slice | torch.Tensor) -> int:
    return channels.stop - channels.start if isinstance(channels, slice) else channels.numel()


def heads_over_whole_rows(mixer: nn.Module, group, rows: RowOrder):
    """``mixer.forward`` for a rank of ``group`` holding some tokens of each row. ``rows(layout)`` gives the global
    index of the tokens as the ranks hold them (rank 0's, then rank 1's, ...; None when that is already the row's
    order) and the layout of the whole row.

    Any mixer of this shape works (Mamba-2, Gated DeltaNet, KDA): ``head_groups`` units of heads, ``project(x)``
    the per-token parts it reads, ``group_channels(first, last)`` the channels of each part that units
    ``[first, last)`` read, ``mix(parts, layout, units, channels)`` their output, then ``out_proj``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = mixer.head_groups // size
    mine = (rank * share, (rank + 1) * share)

    def trade(parts: list[torch.Tensor]) -> torch.Tensor:
        """``parts[r]`` [batch, seq, c] goes to rank ``r``; returns what each rank sent here, [ranks, batch, seq, c]."""
        send = torch.stack(parts)
        rows_each = [send[0].shape[:2].numel()] * size
        return all_to_all_autograd(send.flatten(0, 2), rows_each, rows_each, group).view_as(send)

    owned: list = []  # per rank: the channels of each projected part that its heads read

    def forward(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        held, whole = rows(layout)
        if not owned:  # once the weights are materialized, on their device
            owned.extend(mixer.group_channels(r * share, (r + 1) * share) for r in range(size))
        projected = mixer.project(x)
        parts = [torch.cat([_take(p, c) for p, c in zip(projected, channels)], -1) for channels in owned]
        received = trade(parts)  # [source rank, batch, its tokens, my channels]
        row = received.transpose(0, 1).flatten(1, 2)  # in the order the ranks hold the tokens
        if held is not None:
            row = row[:, torch.argsort(held)]
        sizes = [_width(c) for c in owned[rank]]
        y = mixer.mix(list(row.split(sizes, -1)), whole, mine, owned[rank]).to(x.dtype)
        if held is not None:
            y = y[:, held]
        back = trade(list(y.unflatten(1, (size, -1)).unbind(1)))  # [channel owner, batch, my tokens, its channels]
        return mixer.out_proj(back.permute(1, 2, 0, 3).flatten(2))

    return forward
