"""Mamba-2's state space duality (SSD) scan in plain PyTorch: chunked, batched matmuls, packed-row aware.

The recurrence per head is ``h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_t^T`` and ``y_t = C_t h_t + D x_t``.
The chunked form computes it as four batched matmuls (Mamba-2 paper, section 6): attention-like products
inside each chunk, the state each chunk leaves behind, the decay of those states across chunks, and their
read-out by ``C``. Heads that share a ``B``/``C`` group are broadcast rather than copied, so ``C B^T`` is
computed once per group.

Packed rows (``seq_idx``): a token never sees the state of an earlier sequence, which is the same as a
decay of zero across every sequence start; each of the four terms masks pairs of positions that lie in
different sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_moe.models.layers.decay import pairwise_decay
from lightning_moe.models.layers.upcast import upcast


def _chunked(t: torch.Tensor, chunks: int) -> torch.Tensor:
    """[batch, seq, ...] -> [batch, chunks, chunk, ...]."""
    return t.reshape(t.shape[0], chunks, -1, *t.shape[2:])


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selective scan of ``x`` [batch, seq, heads, head_dim] from a zero state, in fp32.

    ``dt`` [batch, seq, heads] is the discretization step (softplus and limits already applied), ``A`` [heads]
    the negative decay rates, ``B``/``C`` [batch, seq, groups, state] the input/output projections shared by
    ``heads // groups`` heads each, ``D`` [heads] the skip weight, ``seq_idx`` [batch, seq] the sequence each
    token belongs to (None: one sequence per row). Returns fp32 [batch, seq, heads, head_dim].
    """
    # fp32 also under autocast (bf16-mixed), which would run the matmuls of the decays in bf16
    with torch.autocast(x.device.type, enabled=False):
        return _ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, seq_idx)


def _ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, seq_idx):
    batch, seq_len, heads, head_dim = x.shape
    groups = B.shape[2]
    per_group = heads // groups
    pad = (-seq_len) % chunk_size
    x, dt, B, C = upcast(x), upcast(dt), upcast(B), upcast(C)
    skip = x * upcast(D)[:, None] if D is not None else None
    if pad:
        # zero steps: no decay and no input, so padding changes nothing before it
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        if seq_idx is not None:
            seq_idx = F.pad(seq_idx, (0, pad), mode="replicate")
    chunks = (seq_len + pad) // chunk_size

    # [batch, groups, per_group, chunks, chunk, ...]: heads of a group share B and C by broadcasting
    def by_head(t: torch.Tensor) -> torch.Tensor:
        t = _chunked(t, chunks)
        t = t.reshape(*t.shape[:3], groups, per_group, *t.shape[4:])
        return t.permute(0, 3, 4, 1, 2, *range(5, t.dim()))

    def by_group(t: torch.Tensor) -> torch.Tensor:
        return _chunked(t, chunks).permute(0, 3, 1, 2, 4).unsqueeze(2)

    xdt = by_head(x * dt[..., None])  # [b, g, hg, c, l, p]
    log_decay = torch.cumsum(by_head(dt * upcast(A)), dim=-1)  # [b, g, hg, c, l]
    Bg, Cg = by_group(B), by_group(C)  # [b, g, 1, c, l, n]

    same_chunk_seq = end_seq = carry_seq = None
    if seq_idx is not None:
        docs = _chunked(seq_idx, chunks)  # [b, c, l]
        same_chunk_seq = (docs[..., :, None] == docs[..., None, :])[:, None, None]  # [b, 1, 1, c, l, s]
        end_seq = docs[..., -1]  # [b, c]: sequence of each chunk's last token
        # the state entering chunk c belongs to the sequence of the last token of chunk c - 1
        carry_seq = F.pad(end_seq[:, :-1], (1, 0), value=-1)

    # 1. within chunks: y_l += sum_{s <= l} (C_l . B_s) exp(sum_{s < k <= l} dt_k A) dt_s x_s
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    keep = causal if same_chunk_seq is None else causal & same_chunk_seq
    segment = pairwise_decay(log_decay).masked_fill(~keep, float("-inf"))
    scores = (Cg @ Bg.transpose(-1, -2)) * torch.exp(segment)  # [b, g, hg, c, l, s]
    y = scores @ xdt

    # 2. the state each chunk leaves behind: sum_s exp(decay from s to the chunk end) B_s^T dt_s x_s
    to_end = torch.exp(log_decay[..., -1:] - log_decay)
    if end_seq is not None:
        to_end = to_end * (docs == end_seq[..., None])[:, None, None]
    chunk_states = Bg.transpose(-1, -2) @ (xdt * to_end[..., None])  # [b, g, hg, c, n, p]

    # 3. state entering chunk c: sum_{z < c} exp(total decay of chunks z+1 .. c-1) chunk_states_z
    totals = F.pad(torch.cumsum(log_decay[..., -1], dim=-1), (1, 0))  # [b, g, hg, c + 1]
    across = totals[..., :-1, None] - totals[..., None, 1:]  # [.., c (entering), z (source)]
    keep = torch.ones(chunks, chunks, dtype=torch.bool, device=x.device).tril(-1)
    if carry_seq is not None:
        keep = keep & (carry_seq[:, :, None] == end_seq[:, None, :])[:, None, None]
    weights = torch.exp(across.masked_fill(~keep, float("-inf")))
    entering = (weights @ chunk_states.flatten(-2)).view_as(chunk_states)

    # 4. read the entering state out, decayed to each position of the chunk
    from_start = torch.exp(log_decay)
    if carry_seq is not None:
        from_start = from_start * (docs == carry_seq[..., None])[:, None, None]
    y = y + (Cg @ entering) * from_start[..., None]

    y = y.permute(0, 3, 4, 1, 2, 5).reshape(batch, seq_len + pad, heads, head_dim)[:, :seq_len]
    return y + skip if skip is not None else y
