"""Context parallelism: the sequence of every row is split over the ``cp`` ranks; attention gathers keys/values.

Load balance: with causal attention the last tokens of a row attend to the most keys, so each row is cut
into ``2 * cp`` chunks and rank ``r`` takes chunks ``r`` and ``2 * cp - 1 - r``; every rank then does the same
attention work. :func:`shard_batch` applies this cut to every ``[batch, seq]`` tensor of a batch. Labels
are already shifted, so each token keeps its own target and no label crosses a rank.

Inside attention, each rank all-gathers the keys and values of the whole row over the ``cp`` group (the
backward reduce-scatters their gradients) and masks with *global* token indices: causal, sliding window,
and packed-document boundaries from the full row's ``position_ids``, which every rank rebuilds by
all-gathering its local positions once per forward. Rotary embeddings use the local ``position_ids``, which
are already the global positions of the local tokens. The loss of each rank covers its own tokens; the
training module normalizes over data-parallel x context-parallel ranks.

Mamba-2, Gated DeltaNet and KDA mixers trade tokens for heads (``parallel/mamba.py``). Multi-token prediction takes the tokens and targets ``d`` positions ahead from
the whole row (:meth:`ContextParallelRow.full_row`), so they cross rank boundaries as they cross chunks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.layers.loss import IGNORE_INDEX
from lightning_moe.models.layers.sequence import SequenceLayout, create_block_mask
from lightning_moe.parallel.collectives import all_gather_autograd
from lightning_moe.parallel.mamba import heads_over_whole_rows


def balanced_columns(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Global indices of the tokens that rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2*cp-1-rank``."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of 2*cp={2 * cp}; pad rows to a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first = np.arange(rank * chunk, (rank + 1) * chunk)
    return np.concatenate([first, first + (2 * cp - 1 - 2 * rank) * chunk])


def load_balanced_indices(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """:func:`balanced_columns` as a tensor on ``device`` (copied there without waiting for the device)."""
    return torch.from_numpy(balanced_columns(seq_len, cp, rank)).to(device, non_blocking=True)


def shard_batch(batch: dict, cp_mesh) -> dict:
    """This rank's share of every ``[batch, seq, ...]`` tensor; ``position_ids`` are created when absent
    (they carry each token's global position), ``num_label_tokens`` is recounted for the shard and the host
    ``layout`` notes the shard's columns."""
    input_ids = batch["input_ids"]
    rows, seq_len = input_ids.shape[:2]
    columns = balanced_columns(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
    index = torch.from_numpy(columns).to(input_ids.device, non_blocking=True)
    full = dict(batch)
    if full.get("position_ids") is None:
        full["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand(rows, -1)
    out = {}
    for key, value in full.items():
        sequence_shaped = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, seq_len)
        out[key] = value.index_select(1, index) if sequence_shaped else value
    if isinstance(out.get("layout"), BatchLayout):  # the host layout of the same columns
        out["layout"] = out["layout"].shard(columns)
    if "num_label_tokens" in out:
        out["num_label_tokens"] = (out["labels"] != IGNORE_INDEX).sum()
    return out


class ContextParallelRow:
    """Attention geometry of one forward under context parallelism: which global token each local query and
    each gathered key is, and the masks that follow. Plays the role of the layout for the gathered keys."""

    context_parallel = None  # the gathered view is final

    def __init__(self, position_ids: torch.Tensor, group, host: BatchLayout | None = None) -> None:
        self.group = group
        self.host = host  # this rank's host layout: it holds the whole rows
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows, local_len = position_ids.shape
        seq_len = local_len * cp
        device = position_ids.device
        self.query_index = load_balanced_indices(seq_len, cp, rank, device)
        self.key_index = torch.cat([load_balanced_indices(seq_len, cp, r, device) for r in range(cp)])
        gathered = [torch.empty_like(position_ids) for _ in range(cp)]
        dist.all_gather(gathered, position_ids.contiguous(), group=group)
        positions = torch.empty(rows, seq_len, dtype=position_ids.dtype, device=device)
        positions[:, self.key_index] = torch.cat(gathered, dim=1)
        documents = torch.cumsum(positions == 0, dim=1)
        self.positions = positions  # of the whole row, in its natural order
        self._full_layout: SequenceLayout | None = None
        self.query_documents = documents[:, self.query_index]
        self.key_documents = documents[:, self.key_index]
        self.batch = rows
        self._masks: dict = {}

    @property
    def full_layout(self) -> SequenceLayout:
        """The layout of the whole row (Mamba-2 scans and MTP targets need it), built on first use: without the
        host layout, telling whether the row is packed waits for the device."""
        if self._full_layout is None:
            whole = None if self.host is None else BatchLayout(self.host.position_ids, self.host.labels)
            self._full_layout = SequenceLayout(self.positions, host=whole)
        return self._full_layout

    def full_row(self, local: torch.Tensor) -> torch.Tensor:
        """A [batch, local_seq] tensor without gradient (token ids, labels) of every rank -> the whole row, in order."""
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, local.contiguous(), group=self.group)
        full = torch.empty(local.shape[0], self.key_index.numel(), dtype=local.dtype, device=local.device)
        full[:, self.key_index] = torch.cat(gathered, dim=1)
        return full

    def gather(self, k: torch.Tensor, v: torch.Tensor):
        """Keys/values [batch, heads, local_seq, dim] of this rank -> of the whole row (in gathered order)."""
        return all_gather_autograd(k, 2, self.group), all_gather_autograd(v, 2, self.group), self

    def dense_mask(self, window: int | None = None, force: bool = False) -> torch.Tensor:
        """Boolean [batch, 1, local_seq, seq] mask (True = attend); never plain causal, so always a mask."""
        key = ("dense", window)
        if key not in self._masks:
            q, k = self.query_index[:, None], self.key_index[None, :]
            mask = k <= q
            if window is not None:
                mask = mask & (q - k < window)
            mask = mask[None] & (self.query_documents[:, :, None] == self.key_documents[:, None, :])
            self._masks[key] = mask.unsqueeze(1)
        return self._masks[key]

    def block_mask(self, window: int | None = None):
        """flex_attention BlockMask of the same rule."""
        key = ("block", window)
        if key not in self._masks:
            query_index, key_index = self.query_index, self.key_index
            query_docs, key_docs = self.query_documents, self.key_documents

            def mask_mod(b, h, q_idx, kv_idx):
                q, k = query_index[q_idx], key_index[kv_idx]
                keep = (k <= q) & (query_docs[b, q_idx] == key_docs[b, kv_idx])
                if window is not None:
                    keep = keep & (q - k < window)
                return keep

            self._masks[key] = create_block_mask(
                mask_mod, self.batch, None, query_index.numel(), key_index.numel(), device=query_index.device
            )
        return self._masks[key]


def apply_context_parallel(model: nn.Module, cp_mesh, mixer_mesh=None) -> None:
    """Make every attention block of ``model`` attend over the whole row held by ``cp_mesh``, and every Mamba-2,
    Gated DeltaNet and KDA mixer scan it. ``mixer_mesh``: the flattened cp x tp mesh under tensor parallelism,
    whose ranks each hold a sequence-parallel piece of a cp shard; the mixers trade tokens for heads over all of
    them at once (rank ``(c, t)`` holds piece ``t`` of cp rank ``c``'s tokens, so in rank order they are the
    gathered row's tokens in the same order as for cp alone)."""
    group = cp_mesh.get_group()
    mixer_group = (mixer_mesh or cp_mesh).get_group()

    def attach(module, args):
        layout = args[1]
        if layout.context_parallel is None:
            layout.context_parallel = ContextParallelRow(layout.position_ids, group, layout.host)

    blocks = list(model.layers.values())
    if getattr(model, "mtp", None) is not None:
        blocks += [block for depth in model.mtp.depths for block in depth.layers.values()]
    for block in blocks:
        if block.kind.context is not None:
            block.op.register_forward_pre_hook(attach)
        if block.kind.context == "trade_heads":  # Mamba-2, Gated DeltaNet, KDA: heads over the whole row
            block.op.forward = heads_over_whole_rows(block.op, mixer_group, _gathered_row)


def _gathered_row(layout: SequenceLayout) -> tuple[torch.Tensor, SequenceLayout]:
    row = layout.context_parallel
    return row.key_index, row.full_layout
