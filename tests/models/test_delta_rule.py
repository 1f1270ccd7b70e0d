"""The chunked gated delta rule against the token-by-token recurrence (fp64, per-head and per-channel decays,
several chunk sizes, lengths that are not a multiple of the chunk, packed rows), forward and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.layers.delta_rule import chunk_gated_delta_rule


def sequential_delta_rule(q, k, v, g, beta, seq_idx=None, scale=None):
    """S = diag(exp(g_t)) S; S += beta_t k_t (v_t - S^T k_t)^T; o_t = S^T q_t * scale; S = 0 at sequence starts."""
    batch, seq, heads, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    outs = []
    for t in range(seq):
        if seq_idx is not None and t > 0:
            restart = (seq_idx[:, t] != seq_idx[:, t - 1]).view(batch, 1, 1, 1)
            state = torch.where(restart, torch.zeros_like(state), state)
        decay = torch.exp(g[:, t])
        state = state * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        k_t = k[:, t]
        predicted = (state * k_t[..., None]).sum(-2)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, t, ..., None]).sum(-2) * scale)
    return torch.stack(outs, dim=1)


def inputs(per_channel: bool, batch=2, seq=45, heads=3, dk=6, dv=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def unit(t):
        return t / t.norm(dim=-1, keepdim=True)

    q, k, v = unit(randn(batch, seq, heads, dk)), unit(randn(batch, seq, heads, dk)), randn(batch, seq, heads, dv)
    # strong and weak decays, some steps near a full reset
    g_shape = (batch, seq, heads, dk) if per_channel else (batch, seq, heads)
    g = -torch.nn.functional.softplus(randn(*g_shape) * 2)
    beta = torch.sigmoid(randn(batch, seq, heads))
    return q, k, v, g, beta


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(("chunk_size", "seq"), [(16, 45), (32, 45), (64, 45), (16, 64), (32, 7)])
def test_chunked_equals_sequential_recurrence(per_channel, chunk_size, seq):
    q, k, v, g, beta = inputs(per_channel, seq=seq)
    want = sequential_delta_rule(q, k, v, g, beta)
    got = chunk_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)), chunk_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunked_equals_sequential_in_fp64(per_channel):
    """The algorithm itself is exact: fp64 inputs run in fp64, and the two agree to rounding."""
    q, k, v, g, beta = inputs(per_channel, seq=50)
    want = sequential_delta_rule(q, k, v, g, beta)
    got = chunk_gated_delta_rule(q, k, v, g, beta, 16)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("group", [8, 1, 2], ids=["one_group", "chunk_by_chunk", "groups_of_2"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_packed_rows_restart_with_gradients(per_channel, group, monkeypatch):
    """Backward recomputes ``CHUNK_GROUP`` chunks at a time from the states saved between them."""
    from lightning_moe.models.layers import delta_rule

    monkeypatch.setattr(delta_rule, "CHUNK_GROUP", group)
    q, k, v, g, beta = inputs(per_channel, seq=40)
    # row 0: sequences of 5, 19 (crosses chunks), 16; row 1: a start exactly on a chunk boundary (16), a 1-token one
    lengths = [[5, 19, 16], [16, 1, 23]]
    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in lengths])
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    got = chunk_gated_delta_rule(*leaves, 16, seq_idx=seq_idx)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    want = sequential_delta_rule(*ref_leaves, seq_idx=seq_idx)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    weights = torch.randn_like(want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for mine, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(mine.grad, ref.grad, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(("chunk_size", "seq", "group"), [(16, 45, 2), (32, 7, 4), (64, 130, 1), (16, 100, 3)])
def test_gradients_equal_sequential_in_fp64(per_channel, chunk_size, seq, group, monkeypatch):
    """Every input's gradient (the decays and betas too) against autograd through the token recurrence, with
    lengths that pad the last chunk and ``CHUNK_GROUP`` chunks per backward step (the state's gradient crosses
    steps). Gated DeltaNet runs the hand-written backward, KDA autograd through its recomputed forward."""
    from lightning_moe.models.layers import delta_rule

    monkeypatch.setattr(delta_rule, "CHUNK_GROUP", group)
    leaves = [t.requires_grad_() for t in inputs(per_channel, seq=seq, seed=3)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    got = chunk_gated_delta_rule(*leaves, chunk_size)
    want = sequential_delta_rule(*ref_leaves)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=want.dtype)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for name, mine, ref in zip("q k v g beta".split(), leaves, ref_leaves):
        torch.testing.assert_close(mine.grad, ref.grad, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def test_packed_row_equals_its_sequences_alone():
    q, k, v, g, beta = inputs(True, batch=1, seq=37)
    lengths = [9, 20, 8]
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = chunk_gated_delta_rule(q, k, v, g, beta, 16, seq_idx=seq_idx)
    start = 0
    for n in lengths:
        part = [t[:, start:start + n] for t in (q, k, v, g, beta)]
        torch.testing.assert_close(packed[:, start:start + n], chunk_gated_delta_rule(*part, 16), atol=1e-6, rtol=1e-6)
        start += n


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_fp32_under_autocast(per_channel):
    """Forward and backward (also when backward itself runs under autocast) stay fp32."""
    leaves = [t.float().requires_grad_() for t in inputs(per_channel)]
    want = chunk_gated_delta_rule(*leaves, 16)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_gated_delta_rule(*leaves, 16)
        grads = torch.autograd.grad(got.square().sum(), leaves)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    for mine, ref in zip(grads, want_grads):
        torch.testing.assert_close(mine, ref)
