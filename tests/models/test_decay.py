"""``pairwise_decay`` against the plain broadcast difference: bitwise the same values and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.layers.decay import pairwise_decay


def _differences(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x[i] - x[j] by plain indexing (i along the first of the two new dims)."""
    return x[..., :, None] - x[..., None, :] if dim == -1 else x[..., :, None, :] - x[..., None, :, :]


@pytest.mark.parametrize("dim,shape,pairs", [(-1, (2, 3, 8), (2, 3, 8, 8)), (-2, (2, 8, 5), (2, 8, 8, 5))])
def test_pairwise_decay_is_the_broadcast_difference_bitwise(dim, shape, pairs):
    x = torch.cumsum(-torch.rand(shape, generator=torch.Generator().manual_seed(0)), dim=dim).requires_grad_()
    grad = torch.randn(pairs, generator=torch.Generator().manual_seed(1))
    got, expected = pairwise_decay(x, dim), _differences(x, dim)
    assert got.shape == pairs and torch.equal(got, expected)
    assert torch.equal(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])

def test_pairwise_decay_refuses_a_dim_counted_from_the_start():
    with pytest.raises(ValueError, match="counts dim from the end"):
        pairwise_decay(torch.zeros(3, 4), dim=1)
