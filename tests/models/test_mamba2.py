"""Mamba-2 mixer: the chunked SSD scan against the plain recurrence, the mixer against transformers' NemotronH
mixer (forward and gradients, plain and packed rows), and Mamba's initialization."""

from __future__ import annotations

import pytest
import torch
from closeness import assert_matches_float64_reference

from lightning_moe.models.config import MambaConfig
from lightning_moe.models.layers.mamba2 import Mamba2Mixer
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.ssd import ssd_chunk_scan


def sequential_scan(x, dt, A, B, C, D, seq_idx=None):
    """The recurrence token by token: h = exp(dt A) h + dt B x^T, y = C h + D x; h = 0 at every sequence start."""
    batch, seq, heads, head_dim = x.shape
    per_group = heads // B.shape[2]
    B = B.repeat_interleave(per_group, dim=2)
    C = C.repeat_interleave(per_group, dim=2)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    ys = []
    for t in range(seq):
        if seq_idx is not None and t > 0:
            restart = (seq_idx[:, t] != seq_idx[:, t - 1]).view(batch, 1, 1, 1)
            state = torch.where(restart, torch.zeros_like(state), state)
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        ys.append((state * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1)


def scan_inputs(batch=2, seq=45, heads=6, groups=3, head_dim=5, state=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=g, dtype=torch.float64) - 1)
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 3 - 0.1
    B = torch.randn(batch, seq, groups, state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, seq, groups, state, generator=g, dtype=torch.float64)
    D = torch.randn(heads, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunked_scan_equals_sequential_recurrence(chunk_size):
    x, dt, A, B, C, D = scan_inputs()
    want = sequential_scan(x, dt, A, B, C, D)
    got = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)



def test_chunked_scan_stays_fp32_under_autocast():
    """bf16-mixed training runs the mixer under autocast: the scan's matmuls must not drop to bf16."""
    x, dt, A, B, C, D = (t.float() for t in scan_inputs())
    want = ssd_chunk_scan(x, dt, A, B, C, 16, D=D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ssd_chunk_scan(x, dt, A, B, C, 16, D=D)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

def test_chunked_scan_restarts_at_sequence_starts_with_gradients():
    x, dt, A, B, C, D = scan_inputs(seq=40)
    # row 0: sequences of 5, 19 (crosses chunks), 16; row 1: a start exactly on a chunk boundary (16)
    lengths = [[5, 19, 16], [16, 3, 21]]
    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in lengths])
    leaves = [t.float().requires_grad_() for t in (x, dt, A, B, C, D)]
    got = ssd_chunk_scan(*leaves[:5], 8, D=leaves[5], seq_idx=seq_idx)
    ref_leaves = [t.double().detach().requires_grad_() for t in leaves]
    want = sequential_scan(*ref_leaves, seq_idx=seq_idx)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    weights = torch.randn_like(want)
    (got * weights.float()).sum().backward()
    (want * weights).sum().backward()
    for mine, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=1e-3, rtol=1e-4)


# ---------------------------------------------------------------------------------- against transformers
def hf_config(chunk_size=8, **overrides):
    from transformers import NemotronHConfig

    kwargs = dict(
        vocab_size=64, hidden_size=32, layers_block_type=["linear_attention"], ssm_state_size=8,
        mamba_num_heads=6, mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=chunk_size,
        use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5,
    )
    kwargs.update(overrides)
    return NemotronHConfig(**kwargs)


def mamba_config(hf) -> MambaConfig:
    return MambaConfig(
        num_heads=hf.mamba_num_heads, head_dim=hf.mamba_head_dim, state_size=hf.ssm_state_size, n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel, chunk_size=hf.chunk_size, conv_bias=hf.use_conv_bias, proj_bias=hf.use_bias,
        # transformers' NemotronH clamps dt from below at time_step_min
        time_step_limit=(hf.time_step_min, float("inf")), norm_eps=hf.layer_norm_epsilon,
    )


def mixer_pair(seed=0, **overrides):
    """transformers' mixer with random weights (A, D, dt_bias, norm too) and ours holding the same tensors."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(seed)
    hf = hf_config(**overrides)
    theirs = NemotronHMamba2Mixer(hf, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
        theirs.A_log.copy_(torch.rand(hf.mamba_num_heads) * 2 - 1)
        theirs.norm.weight.add_(1.0)
    ours = Mamba2Mixer(mamba_config(hf), hf.hidden_size)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def gradients(model, loss, inputs):
    """``loss(model, inputs)`` backward: its value, the inputs' and every weight's gradient by name."""
    leaves = [x.to(next(model.parameters()).dtype).requires_grad_() for x in inputs]
    value = loss(model, leaves)
    value.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"loss": value.detach(), **grads, **{f"input {i}": x.grad for i, x in enumerate(leaves)}}


@pytest.mark.parametrize("seq", [7, 29])
def test_mixer_matches_transformers(seq):
    theirs, ours = mixer_pair()
    x = torch.randn(2, seq, 32)
    layout = SequenceLayout.from_inputs(x[..., 0].long(), None)
    with torch.no_grad():
        assert_matches_float64_reference(ours, theirs, lambda m: m(x.to(m.out_proj.weight.dtype), layout),
                                         lambda m: m(x.double()), what="mixer")


def test_mixer_gradients_match_transformers():
    theirs, ours = mixer_pair(seed=1, chunk_size=16)
    theirs.train()
    x = torch.randn(2, 40, 32)
    weights = torch.randn(2, 40, 32)
    layout = SequenceLayout.from_inputs(x[..., 0].long(), None)
    assert_matches_float64_reference(
        ours, theirs, lambda m: gradients(m, lambda m, xs: (m(xs[0], layout) * weights.to(xs[0].dtype)).sum(), [x]),
        lambda m: gradients(m, lambda m, xs: (m(xs[0]) * weights.double()).sum(), [x]), what="mixer step")


def test_packed_row_equals_each_sequence_alone():
    """Outputs and gradients (input and every weight, the conv's included) of a packed row equal those of
    transformers running each sequence alone."""
    theirs, ours = mixer_pair(seed=2)
    lengths = [3, 13, 1, 9]  # a 1-token sequence, starts inside and on chunk boundaries (chunk 8)
    parts = [torch.randn(1, n, 32) for n in lengths]
    weights = torch.cat([torch.randn(1, n, 32) for n in lengths], dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    layout = SequenceLayout.from_inputs(position_ids, position_ids)

    def packed(model, xs):
        return (model(xs[0], layout) * weights.to(xs[0].dtype)).sum()

    def alone(model, xs):
        return (torch.cat([model(p) for p in xs[0].split(lengths, dim=1)], dim=1) * weights.double()).sum()

    assert_matches_float64_reference(ours, theirs, lambda m: gradients(m, packed, [torch.cat(parts, dim=1)]),
                                     lambda m: gradients(m, alone, [torch.cat(parts, dim=1)]), what="packed step")


def test_reset_parameters_follows_mamba_init():
    cfg = MambaConfig(num_heads=64, head_dim=4, state_size=8, n_groups=2, chunk_size=8)
    with torch.device("meta"):
        mixer = Mamba2Mixer(cfg, 16)
    mixer.to_empty(device="cpu")
    mixer.reset_parameters(0.02)
    A = -torch.exp(mixer.A_log)
    assert A.min() >= -16 and A.max() <= -1 and A.std() > 1  # uniform in [1, 16], not constant
    assert torch.equal(mixer.D, torch.ones(64))
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= cfg.time_step_min * 0.999 and dt.max() <= cfg.time_step_max * 1.001
    assert torch.equal(mixer.norm.weight, torch.ones(cfg.num_heads * cfg.head_dim))
    assert mixer.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    x = torch.randn(1, 20, 16)
    assert torch.isfinite(mixer(x, SequenceLayout.from_inputs(x[..., 0].long(), None))).all()
