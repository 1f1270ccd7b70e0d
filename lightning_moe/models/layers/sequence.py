"""Where the sequences of a (possibly packed) batch start and end, and the attention masks that follow.

A packed row holds several sequences back to back; a ``position_ids`` value of 0 starts a new one. All
mixers read boundaries from here: attention masks (dense for sdpa, block masks for flex), Mamba's
per-sequence scan restarts (``document_ids``), and varlen ``cu_seqlens``. With the batch's host layout
(:class:`~lightning_moe.models.batch_layout.BatchLayout`) whether rows are packed, ``cu_seqlens`` and the longest
sequence come from the host; without it they are read back from ``position_ids``, a host sync on a GPU.
"""

from __future__ import annotations

import torch

_compiled_create_block_mask = None


def create_block_mask(*args, **kwargs):
    """torch's ``create_block_mask``, compiled once per process: run eagerly it materializes the whole
    ``[batch, seq, seq]`` boolean mask first (gigabytes at long context), compiled it never does."""
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask as create

        _compiled_create_block_mask = torch.compile(create)
    return _compiled_create_block_mask(*args, **kwargs)


class SequenceLayout:
    # under context parallelism, set per forward to the object that gathers the row's keys/values from the
    # other ranks and masks them by global position (``lightning_moe/parallel/context.py``)
    context_parallel = None

    def __init__(self, position_ids: torch.Tensor, packed: bool | None = None, host=None) -> None:
        self.position_ids = position_ids
        self.batch, self.seq_len = position_ids.shape
        self.host = host  # the batch's BatchLayout (this rank's columns), if it came with one
        if packed is None:
            # unpacked batches take the fast causal kernels; without the host layout, a host sync per forward
            packed = host.packed if host is not None else bool((position_ids[:, 1:] == 0).any())
        self.packed = packed
        self._cache: dict = {}  # masks, document ids and offsets, computed on first use

    @classmethod
    def from_inputs(cls, input_ids: torch.Tensor, position_ids: torch.Tensor | None, host=None) -> SequenceLayout:
        if position_ids is None:
            seq = torch.arange(input_ids.shape[1], device=input_ids.device)
            return cls(seq.unsqueeze(0).expand(input_ids.shape[0], -1), packed=False)
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if host is not None and host.shape != tuple(position_ids.shape):
            raise ValueError(f"the batch's layout describes a {host.shape} batch, position_ids are "
                             f"{tuple(position_ids.shape)}: a batch changed after collate needs its layout remade "
                             f"(lightning_moe.models.batch_layout.BatchLayout) or dropped")
        return cls(position_ids, host=host)

    # computed on first use and kept in ``_cache`` (not ``functools.cached_property``: its lock stops
    # torch.compile from tracing compiled blocks that read them)
    @property
    def document_ids(self) -> torch.Tensor:
        """[batch, seq] index of the sequence each token belongs to (0, 1, ... within each row)."""
        if "documents" not in self._cache:
            positions = self.position_ids
            self._cache["documents"] = torch.cumsum(positions == 0, dim=1) - (positions[:, :1] == 0).long()
        return self._cache["documents"]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative sequence lengths over the flattened batch (int32), the varlen kernels' format."""
        if "cu_seqlens" not in self._cache and self.host is not None:
            host = torch.from_numpy(self.host.cu_seqlens)
            self._cache["cu_seqlens"] = host.to(self.position_ids.device, non_blocking=True)
        if "cu_seqlens" not in self._cache:
            starts = self.position_ids == 0
            starts[:, 0] = True
            idx = torch.nonzero(starts.flatten(), as_tuple=True)[0].to(torch.int32)
            total = torch.tensor([self.batch * self.seq_len], dtype=torch.int32, device=idx.device)
            self._cache["cu_seqlens"] = torch.cat([idx, total])
        return self._cache["cu_seqlens"]

    @property
    def max_length(self) -> int:
        """The longest sequence (varlen kernels size their work by it)."""
        if self.host is not None:
            return self.host.max_length
        return int(self.cu_seqlens.diff().max())

    def dense_mask(self, window: int | None = None, force: bool = False) -> torch.Tensor | None:
        """Boolean [batch, 1, seq, seq] mask (True = attend), or None where plain causal attention is exact."""
        if not (self.packed or window is not None or force):
            return None
        key = ("dense", window)
        if key not in self._cache:
            idx = torch.arange(self.seq_len, device=self.position_ids.device)
            mask = idx[:, None] >= idx[None, :]
            if window is not None:
                mask = mask & (idx[:, None] - idx[None, :] < window)
            mask = mask[None]
            if self.packed:
                docs = self.document_ids
                mask = mask & (docs[:, :, None] == docs[:, None, :])
            self._cache[key] = mask.expand(self.batch, -1, -1).unsqueeze(1)
        return self._cache[key]

    def block_mask(self, window: int | None = None):
        """flex_attention BlockMask for causal attention within each sequence (and window)."""
        key = ("block", window)
        if key not in self._cache:
            docs = self.document_ids
            packed = self.packed

            def mask_mod(b, h, q_idx, kv_idx):
                keep = q_idx >= kv_idx
                if window is not None:
                    keep = keep & (q_idx - kv_idx < window)
                if packed:
                    keep = keep & (docs[b, q_idx] == docs[b, kv_idx])
                return keep

            batch = self.batch if packed else None
            self._cache[key] = create_block_mask(
                mask_mod, batch, None, self.seq_len, self.seq_len, device=self.position_ids.device
            )
        return self._cache[key]


def host_label_count(layout: SequenceLayout, depth: int = 0) -> int | None:
    """Labelled tokens of this rank's columns (``depth`` tokens ahead for an MTP depth) from the batch's host
    layout; None without one (the loss then finds them on the device)."""
    return None if layout.host is None or layout.host.labels is None else layout.host.label_tokens(depth)
