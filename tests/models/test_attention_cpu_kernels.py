"""Which CPU SDPA kernel ``attend`` runs, and that the fast path changes no number.

MLA's value head dim is smaller than its query/key head dim; CPU SDPA then falls to its math path (the whole
seq x seq score matrix). ``attend`` pads v with zero channels to the q/k head dim so the flash kernel runs, and
slices the output: outputs and gradients must equal SDPA's math path on the unpadded tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.models.layers.attention import attend
from lightning_moe.models.layers.sequence import SequenceLayout


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _layout(batch: int, seq: int, packed: bool) -> SequenceLayout:
    positions = torch.arange(seq).repeat(batch, 1)
    if packed:  # two sequences per row, split at different places
        positions[0, 5:] -= 5
        positions[1, 11:] -= 11
    return SequenceLayout(positions)


def _reference(q, k, v, layout, scale, window):
    mask = layout.dense_mask(window)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)


@pytest.mark.parametrize("packed,window,kv_heads", [(False, None, 4), (True, None, 4), (False, 6, 2), (True, 6, 4)])
def test_unequal_head_dims_take_flash_and_match_math(packed, window, kv_heads):
    torch.manual_seed(0)
    batch, heads, seq, qk_dim, v_dim = 2, 4, 24, 48, 32
    q = torch.randn(batch, heads, seq, qk_dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, qk_dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, v_dim, requires_grad=True)
    grad_out = torch.randn(batch, heads, seq, v_dim)
    layout, scale = _layout(batch, seq, packed), qk_dim**-0.5

    with OpNames() as ops:
        out = attend(q, k, v, layout, backend="sdpa", scale=scale, window=window)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names
    assert not ops.names & {"bmm", "matmul", "_softmax"}, ops.names  # not the math path

    expected = _reference(q, k, v, layout, scale, window)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_equal_head_dims_take_flash_at_long_rows(packed):
    """GQA with causal rows and with packed-row masks runs the flash kernel, not the math path."""
    q = torch.randn(1, 8, 1024, 64, requires_grad=True)
    k, v = (torch.randn(1, 2, 1024, 64, requires_grad=True) for _ in range(2))
    layout = _layout(2, 1024, packed)
    layout = SequenceLayout(layout.position_ids[:1], packed=packed)
    with OpNames() as ops:
        attend(q, k, v, layout, backend="sdpa", scale=0.125).sum().backward()
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names
    assert not ops.names & {"bmm", "matmul", "_softmax"}, ops.names
