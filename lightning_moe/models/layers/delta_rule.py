"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention) in plain PyTorch: chunked, packed-row aware.

Per head the state ``S`` [key_dim, value_dim] evolves token by token as

    S_t = diag(exp(g_t)) S_{t-1}                      (forget: g_t one log-decay per head, or per key channel)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T         (delta rule: write only what S_t does not yet predict)
    o_t = S_t^T q_t

The chunked (WY / UT-transform) form of the DeltaNet papers computes a chunk of ``C`` tokens at once: the
updates inside a chunk are a unit lower-triangular system ``(I + A) U = [beta v | beta k exp(G)]`` with
``A_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` (``G`` the cumulative log-decay in the chunk), solved once per
chunk (by blocks, see :func:`solve_unit_lower`), after which the state passes from chunk to chunk with three matmuls. Every exponent is a decay between
two positions of the chunk in causal order, so nothing overflows; per-channel decays (KDA) factor each product
through the start of a sub-chunk of ``SUB_CHUNK`` tokens, and only the pairs inside one sub-chunk are formed
channel by channel.

Packed rows (``seq_idx``): pairs of positions in different sequences are masked inside a chunk, and the state
a chunk receives is read only by tokens of the sequence it belongs to, so each sequence starts from zero.

``fla`` (flash-linear-attention) kernels run the same computation on GPUs (``backend="fla"``); they are an
optional dependency, imported only when asked for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SUB_CHUNK = 16
SOLVE_BLOCK = 16
# chunks recomputed together in backward (the memory of their intermediates is what backward holds at once)
RECOMPUTE_CHUNKS = 8


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, fla's (and transformers') normalization of queries and keys."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    seq_idx: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Output of the gated delta rule from a zero state, in fp32 (fp64 inputs: fp64) [batch, seq, heads, value_dim].

    ``q``/``k`` [batch, seq, heads, key_dim] (normalized as the model wants), ``v`` [batch, seq, heads, value_dim],
    ``g`` the log-decay per step (<= 0): [batch, seq, heads] (Gated DeltaNet) or [batch, seq, heads, key_dim]
    (KDA), ``beta`` [batch, seq, heads], ``seq_idx`` [batch, seq] the sequence each token belongs to (None: one
    per row), ``scale`` of the queries (default ``key_dim ** -0.5``).
    """
    # fp32 also under autocast (bf16-mixed), which would run the decays' matmuls in bf16
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, seq_idx, scale)


def _decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``P_ij = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d])`` for ``causal`` pairs (else 0) of each chunk.

    ``a``/``b`` [..., C, d]; ``G`` [..., C] (one decay per head) or [..., C, d] (per channel), non-increasing."""
    if G.dim() == a.dim() - 1:
        segment = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))
        return (a @ b.transpose(-1, -2)) * torch.exp(segment)
    C, d = a.shape[-2:]
    sub = min(SUB_CHUNK, C)
    n = C // sub
    lead = a.shape[:-2]
    a_s, G_s = a.unflatten(-2, (n, sub)), G.unflatten(-2, (n, sub))  # [..., n, sub, d]
    ref = G_s[..., :1, :]  # the decay at each sub-chunk's first token
    # pairs across sub-chunks: through the start of i's sub-chunk, both factors decay (<= 1)
    a_ref = a_s * torch.exp(G_s - ref)
    to_ref = ref - G[..., None, :, :]  # [..., n (i's sub-chunk), C (j), d]
    before = torch.arange(C, device=a.device)[None, :] < torch.arange(0, C, sub, device=a.device)[:, None]  # [n, C]
    b_ref = b[..., None, :, :] * torch.exp(to_ref.masked_fill(~before[..., None], float("-inf")))
    across = (a_ref @ b_ref.transpose(-1, -2)).reshape(*lead, C, C)  # [..., n, sub, C] -> [..., C, C]
    # pairs inside one sub-chunk: channel by channel
    inside = (G_s[..., :, None, :] - G_s[..., None, :, :]).masked_fill(~torch.ones(
        sub, sub, dtype=torch.bool, device=a.device).tril()[..., None], float("-inf"))
    b_s = b.unflatten(-2, (n, sub))
    within = (a_s[..., :, None, :] * b_s[..., None, :, :] * torch.exp(inside)).sum(-1)  # [..., n, sub, sub]
    block = torch.block_diag(*[torch.ones(sub, sub, dtype=torch.bool, device=a.device)] * n)
    full = across.masked_scatter(block.expand_as(across), within.contiguous())
    return full.masked_fill(~causal, 0.0)


def doublings(size: int) -> int:
    """Squarings in :func:`_unit_lower_inverse` of a ``size`` x ``size`` block."""
    return max(math.ceil(math.log2(size)) - 1, 0) if size > 1 else 0


def solve_block(chunk: int) -> int:
    """Rows per diagonal block of :func:`solve_unit_lower` for a chunk of ``chunk`` tokens."""
    return SOLVE_BLOCK if chunk % SOLVE_BLOCK == 0 else chunk


def solve_flops(size: int, width: int) -> int:
    """Matmul FLOPs of :func:`solve_unit_lower` for a ``size`` x ``size`` system with ``width`` right-hand sides."""
    block = solve_block(size)
    blocks = size // block
    return blocks * doublings(block) * 4 * block**3 + 2 * block * block * width * (blocks + blocks * (blocks - 1) // 2)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` [..., b, b]: ``A`` is nilpotent, so the inverse is
    ``sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...``, ``ceil(log2 b)`` factors, all batched matmuls."""
    power = -A
    inverse = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device) + power
    for _ in range(doublings(A.shape[-1])):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``X`` with ``(I + A) X = rhs`` for strictly lower-triangular ``A`` [..., C, C]: diagonal blocks of
    :func:`solve_block` rows inverted by their product form, then block forward substitution. All batched
    matmuls: several times faster than a batched triangular solve on CPUs, and the same numbers to rounding."""
    C = A.shape[-1]
    size = solve_block(C)
    blocks = C // size
    diagonal = torch.stack([A[..., i * size:(i + 1) * size, i * size:(i + 1) * size] for i in range(blocks)], -3)
    inverses = _unit_lower_inverse(diagonal).unbind(-3)
    solved: list[torch.Tensor] = []
    for i in range(blocks):
        rows = slice(i * size, (i + 1) * size)
        known = rhs[..., rows, :]
        for j, done in enumerate(solved):  # block by block: no concatenated copy for autograd to keep
            known = known - A[..., rows, j * size:(j + 1) * size] @ done
        solved.append(inverses[i] @ known)
    return torch.cat(solved, dim=-2)


def _chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, seq_idx, scale):
    batch, seq_len, heads, dk = k.shape
    per_channel = g.dim() == 4
    scale = dk**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q = q * scale
    C = chunk_size
    if per_channel and C % min(SUB_CHUNK, C):
        raise ValueError(f"chunk_size={C} must be a multiple of {SUB_CHUNK} for per-channel decays")
    pad = (-seq_len) % C
    if pad:
        # zero steps: no decay (g = 0) and no write (beta = 0), so padding changes nothing before it
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, 0, 0, pad) if per_channel else (0, 0, 0, pad))
        beta = F.pad(beta, (0, 0, 0, pad))
        if seq_idx is not None:
            seq_idx = F.pad(seq_idx, (0, pad), mode="replicate")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        out = _RecomputedDeltaRule.apply(q, k, v, g, beta, seq_idx, C, RECOMPUTE_CHUNKS)
    else:
        out, _ = _chunks_forward(q, k, v, g, beta, seq_idx, C)
    return out[:, :seq_len]


class _RecomputedDeltaRule(torch.autograd.Function):
    """The delta rule keeping only its inputs and the state entering every ``group`` chunks for backward, which
    recomputes one group at a time (as fla's kernels recompute): the chunks' pairwise products, solves and
    per-chunk states never exist for the whole row at once."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, seq_idx, chunk_size, group):
        span, length = group * chunk_size, q.shape[1]
        outs, states, state = [], [], None
        for start in range(0, length, span):
            states.append(state)
            rows = [t[:, start:start + span] for t in (q, k, v, g, beta)]
            out, state = _chunks_forward(*rows, C=chunk_size, state=state, **_group(seq_idx, start, span, length))
            outs.append(out)
        ctx.save_for_backward(q, k, v, g, beta, *states[1:])
        ctx.seq_idx, ctx.chunk_size, ctx.span = seq_idx, chunk_size, span
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta, *saved = ctx.saved_tensors
        states, span, length = [None, *saved], ctx.span, q.shape[1]
        grads: list[list[torch.Tensor]] = [[] for _ in range(5)]
        grad_state = None
        with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
            for index in reversed(range(len(states))):
                start = index * span
                inputs = [t[:, start:start + span].detach().requires_grad_() for t in (q, k, v, g, beta)]
                entering = None if states[index] is None else states[index].detach().requires_grad_()
                out, leaving = _chunks_forward(*inputs, C=ctx.chunk_size, state=entering,
                                               **_group(ctx.seq_idx, start, span, length))
                outputs, cotangents = [out], [grad[:, start:start + span]]
                if grad_state is not None:
                    outputs.append(leaving)
                    cotangents.append(grad_state)
                wrt = inputs + ([entering] if entering is not None else [])
                found = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True)
                for i, t in enumerate(inputs):
                    grads[i].append(torch.zeros_like(t) if found[i] is None else found[i])
                grad_state = found[5] if entering is not None else None
        return (*(torch.cat(parts[::-1], dim=1) for parts in grads), None, None, None)


def _group(seq_idx: torch.Tensor | None, start: int, span: int, length: int) -> dict:
    """``_chunks_forward``'s packing arguments for the tokens ``[start, start + span)`` of a row of ``length``."""
    docs = None if seq_idx is None else seq_idx[:, start:start + span]
    prev_doc = seq_idx[:, start - 1] if seq_idx is not None and start else None
    return {"seq_idx": docs, "prev_doc": prev_doc, "final_state": start + span < length}


def _chunks_forward(q, k, v, g, beta, seq_idx=None, C=64, state=None, prev_doc=None, final_state=False):
    """Whole chunks (``q`` etc. [batch, chunks * C, heads, ...], scaled and padded) from ``state`` (None: zero),
    whose sequence ``prev_doc`` [batch] is that of the token before them (packed rows); returns the output and,
    with ``final_state``, the state they leave."""
    batch, length, heads, dk = k.shape
    per_channel = g.dim() == 4
    chunks = length // C

    # [batch, heads, chunks, C, ...]
    def chunked(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(batch, chunks, C, heads, *t.shape[3:])
        return t.permute(0, 3, 1, 2, *range(4, t.dim()))

    q, k, v, beta = chunked(q), chunked(k), chunked(v), chunked(beta)
    G = torch.cumsum(chunked(g), dim=3)  # log-decay from the chunk start, [b, h, n, C] or [b, h, n, C, dk]
    G_end = G[:, :, :, -1]  # [b, h, n] or [b, h, n, dk]

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    carry = end = last_doc = None  # per position: reads the state entering the chunk; written into the leaving one
    if seq_idx is not None:
        docs = seq_idx.reshape(batch, chunks, C)
        causal = causal & (docs[..., :, None] == docs[..., None, :])[:, None]  # [b, 1, n, C, C]
        last_doc = docs[..., -1]
        first = torch.full_like(last_doc[:, :1], -1) if prev_doc is None else prev_doc[:, None]
        carry_doc = torch.cat([first, last_doc[:, :-1]], dim=1)  # sequence of the state entering each chunk
        carry = (docs == carry_doc[..., None])[:, None]  # [b, 1, n, C]
        end = (docs == last_doc[..., None])[:, None]
    strict = causal & ~torch.eye(C, dtype=torch.bool, device=q.device)

    def channel_decay(t: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
        return t * torch.exp(exponent if per_channel else exponent[..., None])

    k_beta = k * beta[..., None]
    if per_channel:
        A = _decayed_products(k_beta, k, G, strict)
        qk = _decayed_products(q, k, G, causal)
    else:  # one decay matrix for both products (autograd keeps one copy)
        decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))
        A = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
        qk = (q @ k.transpose(-1, -2)) * decay
    k_start = channel_decay(k_beta, G)  # keys decayed back to the chunk start: they read the entering state
    q_start = channel_decay(q, G)
    if carry is not None:
        k_start, q_start = k_start * carry[..., None], q_start * carry[..., None]
    solved = solve_unit_lower(A, torch.cat([v * beta[..., None], k_start], dim=-1))
    U, W = solved.split([v.shape[-1], dk], dim=-1)
    k_end = channel_decay(k, G_end[:, :, :, None] - G)  # keys decayed forward to the chunk end
    if end is not None:
        k_end = k_end * end[..., None]
    state_decay = torch.exp(G_end if per_channel else G_end[..., None].expand(*G_end.shape, dk))[..., None]
    if last_doc is not None:
        # the state survives the chunk only if the whole chunk continues its sequence
        state_decay = state_decay * (last_doc == carry_doc)[:, None, :, None, None]

    # per chunk (unbind: one backward op per tensor, where indexing would add a zero-filled copy per chunk)
    U, W, q_start, qk, k_end = (t.unbind(2) for t in (U, W, q_start, qk, k_end))
    state_decay = state_decay.unbind(2)
    # a zero state is never read, and the state the last chunk leaves only when asked for
    outs, v_new = [], U[0]
    for c in range(chunks):
        if c:
            written = k_end[c - 1].transpose(-1, -2) @ v_new
            state = written if state is None else state_decay[c - 1] * state + written
        v_new = U[c] if state is None else U[c] - W[c] @ state
        outs.append(qk[c] @ v_new if state is None else q_start[c] @ state + qk[c] @ v_new)
    if final_state:
        written = k_end[-1].transpose(-1, -2) @ v_new
        state = written if state is None else state_decay[-1] * state + written
    out = torch.stack(outs, dim=2)  # [b, h, n, C, dv]
    return out.permute(0, 2, 3, 1, 4).reshape(batch, chunks * C, heads, -1), state




def fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens: torch.Tensor | None, scale: float | None = None):
    """The same computation with fla's GPU kernels (optional dependency). ``cu_seqlens`` over the flattened batch."""
    try:
        if g.dim() == 4:
            from fla.ops.kda import chunk_kda as kernel
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError as err:
        raise ImportError(
            "linear_attention.backend='fla' needs flash-linear-attention (pip install flash-linear-attention); "
            "use backend='torch' without it"
        ) from err
    batch = q.shape[0]
    if cu_seqlens is not None:
        q, k, v, g, beta = (t.flatten(0, 1)[None] for t in (q, k, v, g, beta))
    out, _ = kernel(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)
    return out.reshape(batch, -1, *out.shape[2:])
