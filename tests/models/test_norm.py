"""RMSNorm equals the transformers norms it stands for, bitwise, including in bf16 where they differ."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.layers.norm import RMSNorm


@pytest.mark.parametrize("reference,weight_fp32", [
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", False),
    ("transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm", True),
    ("transformers.models.nemotron_h.modeling_nemotron_h.NemotronHRMSNorm", True),
])
def test_rms_norm_matches_transformers_in_bf16(reference, weight_fp32):
    import importlib

    module, _, name = reference.rpartition(".")
    theirs = getattr(importlib.import_module(module), name)(64, eps=1e-5).to(torch.bfloat16)
    ours = RMSNorm(64, eps=1e-5, weight_fp32=weight_fp32).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.3)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    # and the other style differs: the flag is what makes them agree
    other = RMSNorm(64, eps=1e-5, weight_fp32=not weight_fp32).to(torch.bfloat16)
    other.load_state_dict(ours.state_dict())
    assert not torch.equal(other(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_fp32,offset", [(False, False), (True, False), (False, True)])
def test_rms_norm_backward_keeps_input_and_rstd_and_equals_autograd(dtype, weight_fp32, offset):
    """The hand-written backward against autograd through the forward's own expression (the normalized rows
    recomputed instead of kept), and what it keeps: the input and one rstd per row."""
    import torch.nn.functional as F

    norm = RMSNorm(64, eps=1e-5, weight_fp32=weight_fp32, offset=offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.5, 0.3)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(4, 9, 64, generator=gen)).to(dtype).requires_grad_()
    grad = torch.randn(4, 9, 64, generator=gen).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(x)
    assert [tuple(t.shape) for t in saved if t.dim() > 1] == [(4, 9, 64), (4, 9, 1)]
    got = torch.autograd.grad(out, (x, norm.weight), grad)

    x_ref, w_ref = x.detach().float().requires_grad_(), norm.weight.detach().float().requires_grad_()
    normed = F.rms_norm(x_ref, (64,), eps=1e-5)
    ref = normed * (1.0 + w_ref) if offset else w_ref * normed
    want = torch.autograd.grad(ref, (x_ref, w_ref), grad.float())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, **tol)
