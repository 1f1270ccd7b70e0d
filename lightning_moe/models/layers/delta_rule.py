"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention) in plain PyTorch: chunked, packed-row aware.

Per head the state ``S`` [key_dim, value_dim] evolves token by token as

    S_t = diag(exp(g_t)) S_{t-1}                      (forget: g_t one log-decay per head, or per key channel)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T         (delta rule: write only what S_t does not yet predict)
    o_t = S_t^T q_t

The chunked (WY / UT-transform) form of the DeltaNet papers computes a chunk of ``C`` tokens at once: the
updates inside a chunk are a unit lower-triangular system ``(I + A) U = [beta v | beta k exp(G)]`` with
``A_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` (``G`` the cumulative log-decay in the chunk), solved once per
chunk through its inverse (by blocks, see :func:`unit_lower_inverse`), after which the state passes from chunk
to chunk with three matmuls. Every exponent is a decay between two positions of the chunk in causal order, so nothing overflows; per-channel decays (KDA) factor each product
through the start of a sub-chunk of ``SUB_CHUNK`` tokens, and only the pairs inside one sub-chunk are formed
channel by channel.

Backward: with one decay per head (Gated DeltaNet) a hand-written one (:class:`_HeadDecayDeltaRule`: the
state's gradient backward over chunks, everything else batched over chunks); with per-channel decays (KDA)
autograd through a forward recomputed a group of chunks at a time (:class:`_RecomputedDeltaRule`).

Packed rows (``seq_idx``): pairs of positions in different sequences are masked inside a chunk, and the state
a chunk receives is read only by tokens of the sequence it belongs to, so each sequence starts from zero.

``fla`` (flash-linear-attention) kernels run the same computation on GPUs (``backend="fla"``); they are an
optional dependency, imported only when asked for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_moe.models.layers.decay import pairwise_decay
from lightning_moe.models.layers.upcast import upcast_dtype

SUB_CHUNK = 16
SOLVE_BLOCK = 16
# chunks computed together (their intermediates are what backward holds at once)
CHUNK_GROUP = 4


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

    ``a``/``b`` [..., C, d]; ``G`` [..., C, d] (per channel), non-increasing."""
    C, d = a.shape[-2:]
    sub = min(SUB_CHUNK, C)
    n = C // sub
    lead = a.shape[:-2]
    a_s, G_s = a.unflatten(-2, (n, sub)), G.unflatten(-2, (n, sub))  # [..., n, sub, d]
    ref = G_s[..., :1, :]  # the decay at each sub-chunk's first token
    # pairs across sub-chunks: through the start of i's sub-chunk, both factors decay (<= 1)
    a_ref = a_s * torch.exp(G_s - ref)
    # a + (-b), bitwise a - b: backward negates G's own gradient, not the broadcast one (as pairwise_decay)
    to_ref = ref + (-G)[..., None, :, :]  # [..., n (i's sub-chunk), C (j), d]
    before = torch.arange(C, device=a.device)[None, :] < torch.arange(0, C, sub, device=a.device)[:, None]  # [n, C]
    b_ref = b[..., None, :, :] * torch.exp(to_ref.masked_fill(~before[..., None], float("-inf")))
    across = (a_ref @ b_ref.transpose(-1, -2)).reshape(*lead, C, C)  # [..., n, sub, C] -> [..., C, C]
    # pairs inside one sub-chunk: channel by channel
    inside = pairwise_decay(G_s, dim=-2).masked_fill(~torch.ones(
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
    """Rows per diagonal block of :func:`unit_lower_inverse` for a chunk of ``chunk`` tokens."""
    return SOLVE_BLOCK if chunk % SOLVE_BLOCK == 0 else chunk


def inverse_flops(size: int) -> int:
    """Matmul FLOPs of :func:`unit_lower_inverse` of a ``size`` x ``size`` matrix."""
    block = solve_block(size)
    blocks = size // block
    off_diagonal = sum(2 * block * (i * block) ** 2 + 2 * block * block * i * block for i in range(1, blocks))
    return blocks * doublings(block) * 4 * block**3 + off_diagonal


def solve_flops(size: int, width: int) -> int:
    """Matmul FLOPs of solving ``(I + A) X = rhs`` for ``width`` right-hand sides: the inverse, then one product."""
    return inverse_flops(size) + 2 * size * size * width


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` [..., b, b]: ``A`` is nilpotent, so the inverse is
    ``sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...``, ``ceil(log2 b)`` factors, all batched matmuls."""
    power = -A
    inverse = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device) + power
    for _ in range(doublings(A.shape[-1])):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` [..., C, C]: diagonal blocks of :func:`solve_block`
    rows inverted by their product form, then block row by block row ``T_ij = -T_ii sum_k A_ik T_kj``. All
    batched matmuls: several times faster than a batched triangular solve on CPUs, the same numbers to rounding.
    Kept explicit (as fla keeps it) so backward reuses it: ``dR = T^T dX``, ``dA = -dR X^T``."""
    C = A.shape[-1]
    size = solve_block(C)
    blocks = C // size
    diagonal = torch.stack([A[..., i * size:(i + 1) * size, i * size:(i + 1) * size] for i in range(blocks)], -3)
    inverses = _unit_lower_inverse(diagonal).unbind(-3)
    rows = [inverses[0]]  # block row i: [..., size, (i + 1) * size]
    for i in range(1, blocks):
        above = torch.cat([F.pad(row, (0, i * size - row.shape[-1])) for row in rows], dim=-2)
        left = -inverses[i] @ (A[..., i * size:(i + 1) * size, :i * size] @ above)
        rows.append(torch.cat([left, inverses[i]], dim=-1))
    return torch.cat([F.pad(row, (0, C - row.shape[-1])) for row in rows], dim=-2)


def _chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, seq_idx, scale):
    batch, seq_len, heads, dk = k.shape
    per_channel = g.dim() == 4
    scale = dk**-0.5 if scale is None else scale
    dtype = upcast_dtype(q.dtype)
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
    if not per_channel:
        out = _HeadDecayDeltaRule.apply(q, k, v, g, beta, seq_idx, C, CHUNK_GROUP)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        out = _RecomputedDeltaRule.apply(q, k, v, g, beta, seq_idx, C, CHUNK_GROUP)
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


class _HeadDecayDeltaRule(torch.autograd.Function):
    """The delta rule with one decay per head (Gated DeltaNet) and a hand-written backward. Forward keeps its
    inputs, the state entering every chunk and every chunk's inverse ``T`` (as fla keeps its ``A``: the same size
    as the states when ``C`` equals the head dims); backward recomputes the rest of the chunk-parallel part
    (decays, ``k k^T``, ``q k^T``, ``U``/``W``) ``group`` chunks at a time, runs the state gradient backward over the
    chunks (two matmuls a chunk), and forms every other gradient with batched matmuls over all chunks of the
    group (the order of fla's ``chunk_gated_delta_rule`` backward)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, seq_idx, chunk_size, group):
        span, length = group * chunk_size, q.shape[1]
        outs, states, inverses, state = [], [], [], None
        for start in range(0, length, span):
            parts = _head_decay_chunks(*(t[:, start:start + span] for t in (q, k, v, g, beta)),
                                       C=chunk_size, **_group(seq_idx, start, span, length, state=False))
            out, entering, state = _scan(parts, state)
            outs.append(out)
            states.append(entering)
            inverses.append(parts["T"])
        ctx.save_for_backward(q, k, v, g, beta, *states, *inverses)
        ctx.seq_idx, ctx.chunk_size, ctx.span = seq_idx, chunk_size, span
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta, *saved = ctx.saved_tensors
        states, inverses = saved[:len(saved) // 2], saved[len(saved) // 2:]
        span, length = ctx.span, q.shape[1]
        grads: list[list[torch.Tensor]] = [[] for _ in range(5)]
        grad_state = None
        with torch.autocast(q.device.type, enabled=False):  # fp32 matmuls also when backward runs under autocast
            for index in reversed(range(len(states))):
                start = index * span
                rows = [t[:, start:start + span] for t in (q, k, v, g, beta)]
                parts = _head_decay_chunks(*rows, C=ctx.chunk_size, T=inverses[index],
                                           **_group(ctx.seq_idx, start, span, length, False))
                found, grad_state = _head_decay_backward(parts, states[index],
                                                         grad[:, start:start + span].to(q.dtype), grad_state)
                for i, t in enumerate(found):
                    grads[i].append(t)
        return (*(torch.cat(parts[::-1], dim=1) for parts in grads), None, None, None)


def _to_chunks(t: torch.Tensor, C: int) -> torch.Tensor:
    """[batch, chunks * C, heads, ...] -> [batch, heads, chunks, C, ...]."""
    batch, length, heads = t.shape[:3]
    t = t.reshape(batch, length // C, C, heads, *t.shape[3:])
    return t.permute(0, 3, 1, 2, *range(4, t.dim())).contiguous()  # matmuls would copy a permuted view each time


def _from_chunks(t: torch.Tensor) -> torch.Tensor:
    """[batch, heads, chunks, C, ...] -> [batch, chunks * C, heads, ...]."""
    batch, heads, chunks, C = t.shape[:4]
    return t.permute(0, 2, 3, 1, *range(4, t.dim())).reshape(batch, chunks * C, heads, *t.shape[4:])


def _head_decay_chunks(q, k, v, g, beta, seq_idx=None, C=64, prev_doc=None, T=None) -> dict[str, torch.Tensor]:
    """Everything chunk-parallel of the delta rule with one decay per head, [batch, heads, chunks, C, ...]:
    ``A`` (strictly lower) and its inverse ``T`` (given: not recomputed), ``X = T [beta v | beta k e^G]``
    (``U | W``), ``qk``, the masked decays, and the keys/queries decayed to the chunk start/end. Packed rows mask
    as :func:`_chunks_forward`."""
    q, k, v, g, beta = (_to_chunks(t, C) for t in (q, k, v, g, beta))
    G = torch.cumsum(g, dim=-1)
    G_end = G[..., -1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    e_start, e_end, state_decay = torch.exp(G), torch.exp(G_end[..., None] - G), torch.exp(G_end)
    if seq_idx is not None:
        docs = seq_idx.reshape(seq_idx.shape[0], -1, C)
        causal = causal & (docs[..., :, None] == docs[..., None, :])[:, None]
        last_doc = docs[..., -1]
        first = torch.full_like(last_doc[:, :1], -1) if prev_doc is None else prev_doc[:, None]
        carry_doc = torch.cat([first, last_doc[:, :-1]], dim=1)
        e_start = e_start * (docs == carry_doc[..., None])[:, None]
        e_end = e_end * (docs == last_doc[..., None])[:, None]
        state_decay = state_decay * (last_doc == carry_doc)[:, None]
    decay = torch.exp(pairwise_decay(G).masked_fill(~causal, float("-inf")))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay
    A.diagonal(dim1=-2, dim2=-1).zero_()  # strictly lower: decay is zero above the diagonal
    T = unit_lower_inverse(A) if T is None else T
    k_start = k_beta * e_start[..., None]
    X = T @ torch.cat([v_beta, k_start], dim=-1)
    return {"q": q, "k": k, "v": v, "beta": beta, "k_beta": k_beta, "decay": decay, "A": A, "T": T, "X": X,
            "qk": (q @ k.transpose(-1, -2)) * decay, "e_start": e_start, "k_start": k_start,
            "q_start": q * e_start[..., None], "e_end": e_end, "k_end": k * e_end[..., None],
            "state_decay": state_decay}


def _scan(parts: dict[str, torch.Tensor], state: torch.Tensor | None):
    """Output [batch, chunks * C, heads, dv], the states entering every chunk [b, h, chunks, dk, dv] and the
    state leaving the last, from ``state`` (None: zero). The loop holds only what passes between chunks."""
    dv = parts["v"].shape[-1]
    U, W = parts["X"].split([dv, parts["X"].shape[-1] - dv], dim=-1)
    if state is None:
        state = U.new_zeros(*U.shape[:2], W.shape[-1], dv)
    entering, v_new = [], []
    for c, (u, w, k_end, decay) in enumerate(zip(U.unbind(2), W.unbind(2), parts["k_end"].unbind(2),
                                                 parts["state_decay"].unbind(2))):
        entering.append(state)
        v_new.append(u - w @ state)
        state = decay[..., None, None] * state + k_end.transpose(-1, -2) @ v_new[c]
    states = torch.stack(entering, dim=2)
    out = parts["q_start"] @ states + parts["qk"] @ torch.stack(v_new, dim=2)
    return _from_chunks(out), states, state


def _head_decay_backward(parts, states, grad_out, grad_state):
    """Gradients of ``q, k, v, g, beta`` (each [batch, chunks * C, heads, ...]) of a run of chunks from
    :func:`_head_decay_chunks`, their entering ``states`` and the gradients of their output and of the state they
    leave (None: zero); and the gradient of the state entering them."""
    q, k, v, beta, T, X = (parts[n] for n in ("q", "k", "v", "beta", "T", "X"))
    dv = v.shape[-1]
    U, W = X.split([dv, X.shape[-1] - dv], dim=-1)
    v_new = U - W @ states
    d_out = _to_chunks(grad_out, q.shape[-2])
    # the state's gradient, chunk by chunk backward: S_{c+1} = decay_c S_c + k_end_c^T v_new_c,
    # v_new_c = U_c - W_c S_c, out_c = q_start_c S_c + qk_c v_new_c
    from_out = parts["qk"].transpose(-1, -2) @ d_out  # v_new's gradient through the output
    read = parts["q_start"].transpose(-1, -2) @ d_out  # the state's gradient through the output
    grad_state = states.new_zeros(states[:, :, 0].shape) if grad_state is None else grad_state
    d_v_new, leaving = [], []
    for c in reversed(range(q.shape[2])):
        leaving.append(grad_state)
        d_v_new.append(from_out[:, :, c] + parts["k_end"][:, :, c] @ grad_state)
        grad_state = (parts["state_decay"][:, :, c, None, None] * grad_state + read[:, :, c]
                      - W[:, :, c].transpose(-1, -2) @ d_v_new[-1])
    d_v_new, leaving = torch.stack(d_v_new[::-1], dim=2), torch.stack(leaving[::-1], dim=2)
    states_t = states.transpose(-1, -2)
    d_qk = d_out @ v_new.transpose(-1, -2)
    d_q_start = d_out @ states_t
    d_k_end = v_new @ leaving.transpose(-1, -2)
    d_state_decay = (states * leaving).sum((-1, -2))
    d_X = torch.cat([d_v_new, -d_v_new @ states_t], dim=-1)
    # X = T R: dR = T^T dX, dA = -T^T dX X^T (strictly lower, as A)
    d_R = T.transpose(-1, -2) @ d_X
    d_A = -(d_R @ X.transpose(-1, -2))  # only its strictly lower part reaches A's inputs: A is zero elsewhere
    d_v_beta, d_k_start = d_R.split([dv, d_R.shape[-1] - dv], dim=-1)
    d_kk, d_qk_raw = d_A * parts["decay"], d_qk * parts["decay"]
    d_kk.diagonal(dim1=-2, dim2=-1).zero_()
    d_k_beta = d_kk @ k + d_k_start * parts["e_start"][..., None]
    d_q = d_qk_raw @ k + d_q_start * parts["e_start"][..., None]
    d_k = (d_kk.transpose(-1, -2) @ parts["k_beta"] + d_qk_raw.transpose(-1, -2) @ q
           + d_k_end * parts["e_end"][..., None] + d_k_beta * beta[..., None])
    # cumulative log-decays: pairs (i, j) decay by G_i - G_j, starts by G_i, ends by G_end - G_i
    pairs = d_A * parts["A"] + d_qk * parts["qk"]
    to_end = (d_k_end * parts["k_end"]).sum(-1)
    d_G = (pairs.sum(-1) - pairs.sum(-2) + (d_k_start * parts["k_start"]).sum(-1)
           + (d_q_start * parts["q_start"]).sum(-1) - to_end)
    d_G[..., -1] += to_end.sum(-1) + d_state_decay * parts["state_decay"]
    d_g = d_G.flip(-1).cumsum(-1).flip(-1)
    d_beta = (d_k_beta * k).sum(-1) + (d_v_beta * v).sum(-1)
    return [_from_chunks(t) for t in (d_q, d_k, d_v_beta * beta[..., None], d_g, d_beta)], grad_state


def _group(seq_idx: torch.Tensor | None, start: int, span: int, length: int, state: bool = True) -> dict:
    """The packing arguments for the tokens ``[start, start + span)`` of a row of ``length`` (with ``state``:
    also whether ``_chunks_forward`` returns the state they leave)."""
    docs = None if seq_idx is None else seq_idx[:, start:start + span]
    prev_doc = seq_idx[:, start - 1] if seq_idx is not None and start else None
    return {"seq_idx": docs, "prev_doc": prev_doc, **({"final_state": start + span < length} if state else {})}


def _chunks_forward(q, k, v, g, beta, seq_idx=None, C=64, state=None, prev_doc=None, final_state=False):
    """Whole chunks with per-channel decays (``q`` etc. [batch, chunks * C, heads, ...], scaled and padded) from
    ``state`` (None: zero), whose sequence ``prev_doc`` [batch] is that of the token before them (packed rows);
    returns the output and, with ``final_state``, the state they leave. Differentiable (KDA's backward)."""
    batch, length, heads, dk = k.shape
    chunks = length // C
    q, k, v, beta, g = (_to_chunks(t, C) for t in (q, k, v, beta, g))
    G = torch.cumsum(g, dim=3)  # log-decay from the chunk start, [b, h, n, C, dk]
    G_end = G[:, :, :, -1]  # [b, h, n, dk]

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

    k_beta = k * beta[..., None]
    A = _decayed_products(k_beta, k, G, strict)
    qk = _decayed_products(q, k, G, causal)
    k_start = k_beta * torch.exp(G)  # keys decayed back to the chunk start: they read the entering state
    q_start = q * torch.exp(G)
    if carry is not None:
        k_start, q_start = k_start * carry[..., None], q_start * carry[..., None]
    solved = unit_lower_inverse(A) @ torch.cat([v * beta[..., None], k_start], dim=-1)
    U, W = solved.split([v.shape[-1], dk], dim=-1)
    k_end = k * torch.exp(G_end[:, :, :, None] - G)  # keys decayed forward to the chunk end
    if end is not None:
        k_end = k_end * end[..., None]
    state_decay = torch.exp(G_end)[..., None]
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
    return _from_chunks(torch.stack(outs, dim=2)), state




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
