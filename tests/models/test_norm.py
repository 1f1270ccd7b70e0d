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
